"""LoRA adapters behind the OpenAI API: chosen by `model` (the official client), listed with their parent, loaded and
unloaded at run time with vLLM's routes and error shapes, refused by name, and counted in the metrics the Inference
Extension's picker reads."""

import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.testing.lora_adapters import write_peft_adapter
from tests.server_harness import TINY_MODEL, assert_openai_error, tiny_server, wait_for

PROMPT = "In the beginning God created"


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory) -> dict[str, str]:
    root, base = tmp_path_factory.mktemp("server-adapters"), tiny_checkpoints["llama"]
    return {
        "attn": str(
            write_peft_adapter(base, root / "attn", seed=1, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        ),
        "mlp": str(write_peft_adapter(base, root / "mlp", seed=2, r=4, target_modules=["gate_proj", "down_proj"])),
    }


@pytest.fixture(scope="module")
def server(tiny_checkpoints, adapters):
    with tiny_server(tiny_checkpoints, enable_lora=True, max_loras=2, lora_modules=[f"attn={adapters['attn']}"],
                     allow_runtime_lora_updating=True) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def _peft_completion(model_dir, adapter_dir: str, tokenizer, max_tokens: int) -> str:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.load_adapter(adapter_dir)
    input_ids = torch.tensor([tokenizer.encode(PROMPT)])
    output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False)  # fmt: skip
    return tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)


def _complete(client: openai.OpenAI, model: str, **fields) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, **fields)


def test_the_models_list_shows_adapters_with_their_parent(client, adapters):
    models = {model.id: model for model in client.models.list().data}
    assert set(models) == {TINY_MODEL, "attn"}
    assert models["attn"].model_extra["parent"] == TINY_MODEL and models["attn"].model_extra["root"] == adapters["attn"]
    assert models[TINY_MODEL].model_extra["parent"] is None
    assert client.models.retrieve("attn").id == "attn"


def test_a_request_naming_an_adapter_gets_hf_and_pefts_text(client, tiny_checkpoints, adapters, tokenizer):
    completion = _complete(client, "attn", extra_body={"ignore_eos": True})
    assert completion.model == "attn"
    expected = _peft_completion(tiny_checkpoints["llama"], adapters["attn"], tokenizer, 8)
    assert completion.choices[0].text == expected
    assert _complete(client, TINY_MODEL, extra_body={"ignore_eos": True}).choices[0].text != expected


def test_chat_streams_under_an_adapter(client):
    stream = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"attn"}
    whole = client.chat.completions.create(model="attn", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                           temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == whole.choices[0].message.content


def test_structured_output_under_an_adapter(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    completion = client.chat.completions.create(
        model="attn", messages=[{"role": "user", "content": "A number"}], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )  # fmt: skip
    assert isinstance(json.loads(completion.choices[0].message.content)["n"], int)


def test_an_unknown_model_is_a_404_in_the_openai_shape(client):
    with pytest.raises(openai.NotFoundError) as refused:
        _complete(client, "no-such-adapter")
    assert refused.value.code == "model_not_found" and "'attn'" in refused.value.message


def test_an_adapter_loaded_at_run_time_serves_the_tokens_of_one_loaded_at_start(server, client, adapters):
    expected = _complete(client, "attn").choices[0].text
    load = httpx.post(
        f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "attn-2", "lora_path": adapters["attn"]}
    )
    assert load.status_code == 200 and load.text == "Success: LoRA adapter 'attn-2' added successfully."
    assert _complete(client, "attn-2").choices[0].text == expected
    assert "attn-2" in {model.id for model in client.models.list().data}
    unload = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "attn-2"})
    assert unload.status_code == 200 and unload.text == "Success: LoRA adapter 'attn-2' removed successfully."
    with pytest.raises(openai.NotFoundError):
        _complete(client, "attn-2")
    again = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "attn-2"})
    assert_openai_error(again, 404, param="lora_name")


def test_load_inplace_replaces_the_weights_under_the_name(server, client, adapters):
    url = f"{server.base_url}/v1/load_lora_adapter"
    assert httpx.post(url, json={"lora_name": "swapped", "lora_path": adapters["attn"]}).status_code == 200
    refused = httpx.post(url, json={"lora_name": "swapped", "lora_path": adapters["mlp"]})
    assert "load_inplace" in assert_openai_error(refused, 400, param="lora_name")["message"]
    replaced = httpx.post(url, json={"lora_name": "swapped", "lora_path": adapters["mlp"], "load_inplace": True})
    assert replaced.status_code == 200
    assert httpx.post(url, json={"lora_name": "mlp", "lora_path": adapters["mlp"]}).status_code == 200
    assert _complete(client, "swapped").choices[0].text == _complete(client, "mlp").choices[0].text
    for name in ("swapped", "mlp"):
        assert httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"lora_name": "x", "lora_path": "/no/such/dir"}, 404, "lora_path"),
        ({"lora_name": "", "lora_path": "/tmp"}, 400, "lora_name"),
        ({"lora_name": TINY_MODEL, "lora_path": "/tmp"}, 400, "lora_name"),
        ({"lora_name": "x", "lora_path": "/tmp", "is_3d_lora_weight": True}, 400, "is_3d_lora_weight"),
        ({"lora_name": "x", "lora_path": "/tmp", "base_model_name": "y"}, 400, "base_model_name"),
    ],
)
def test_bad_loads_are_refused_by_name(server, body, status, param):
    assert_openai_error(httpx.post(f"{server.base_url}/v1/load_lora_adapter", json=body), status, param=param)


def test_an_adapter_kvserve_cannot_run_is_a_400_naming_why(server, tiny_checkpoints, tmp_path):
    dora = write_peft_adapter(tiny_checkpoints["llama"], tmp_path / "dora", seed=0, r=4, target_modules=["q_proj"],
                              use_dora=True)  # fmt: skip
    refused = httpx.post(f"{server.base_url}/v1/load_lora_adapter", json={"lora_name": "d", "lora_path": str(dora)})
    assert "DoRA" in assert_openai_error(refused, 400, param="lora_path")["message"]
    unload = httpx.post(f"{server.base_url}/v1/unload_lora_adapter", json={"lora_name": "attn", "lora_int_id": 99})
    assert_openai_error(unload, 400, param="lora_int_id")


def test_the_picker_sees_the_running_and_waiting_adapters(server, client):
    registry = server.ctx.metrics.registry
    _complete(client, "attn")
    wait_for(lambda: server.ctx.engine.num_in_flight == 0)
    info = [s for metric in registry.collect() if metric.name == "vllm:lora_requests_info" for s in metric.samples]
    assert len(info) == 1 and info[0].labels["max_lora"] == "2" and info[0].value > 0
    stream = client.completions.create(model="attn", prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    wait_for(lambda: server.metric("lora_requests_running", lora_name="attn") == 1)
    info = [s for metric in registry.collect() if metric.name == "vllm:lora_requests_info" for s in metric.samples]
    assert [sample.labels["running_lora_adapters"] for sample in info] == ["attn"]
    stream.close()


def test_without_the_flag_there_are_no_load_routes(tiny_checkpoints):
    with tiny_server(tiny_checkpoints, enable_lora=True) as running:
        response = httpx.post(f"{running.base_url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
        assert response.status_code == 404
