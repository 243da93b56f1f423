"""lm-evaluation-harness scores the server as its `local-completions` model, as published evals do.

Two small local tasks (tests/data/lm_eval) run end to end against a live server on the tiny Llama: a
`generate_until` task (short answers to plain questions) and a `multiple_choice` task (the true next
sentence among four). lm-eval sends token-id prompts; for each choice it asks for `echo` with
`logprobs: 1` and one new token, and sums the echoed prompt logprobs of the choice's tokens. Those sums
must be the numbers the offline engine and HF transformers compute for the same token ids.
"""

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from kvserve.engine import LLM, SamplingParams
from tests.lm_eval_tasks import DATA_DIR, evaluate, local_completions
from tests.server_harness import TINY_KV_CACHE_BYTES, TINY_MODEL, tiny_server

MULTIPLE_CHOICE = "kvserve_next_sentence"
GENERATE_UNTIL = "kvserve_short_answers"
TASK_FILES = {MULTIPLE_CHOICE: "next_sentence.yaml", GENERATE_UNTIL: "short_answers.yaml"}
TOLERANCE = 1e-4  # float32 logprobs, summed over a few dozen tokens
# What lm-eval's local-completions asks for to score a choice: the prompt's logprobs echoed, one new token.
LM_EVAL_SCORING = {"max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}


@dataclass
class Evaluation:
    results: dict  # what lm_eval.simple_evaluate returned, with every request's samples
    sent_prompts: dict[str, list[list[int]]]  # the token-id prompts lm-eval sent, by request kind
    checkpoint: Path
    tokenizer: PreTrainedTokenizerBase  # the one lm-eval tokenized with
    completions_url: str  # of the server, still running

    def samples(self, task: str) -> list[dict]:
        return self.results["samples"][task]


@dataclass(frozen=True)
class ScoredChoice:
    """One multiple-choice request: the tokens lm-eval sent, where its context ends, and what lm-eval made of
    the server's answer."""

    token_ids: list[int]
    context_len: int  # the tokens after it are the choice's, the ones summed
    loglikelihood: float
    is_greedy: bool


@pytest.fixture(scope="module")
def evaluation(tiny_checkpoints, tmp_path_factory) -> Iterator[Evaluation]:
    checkpoint = tiny_checkpoints["llama"]
    with tiny_server(tiny_checkpoints) as server:
        lm = local_completions(server.base_url, TINY_MODEL, checkpoint)
        sent_prompts = record_sent_prompts(lm)
        results = evaluate(lm, TASK_FILES, tmp_path_factory.mktemp("lm_eval_tasks"), log_samples=True)
        yield Evaluation(results, sent_prompts, checkpoint, lm.tokenizer, lm.base_url)


@pytest.fixture(scope="module")
def offline_llm(evaluation) -> LLM:
    """The offline engine on the checkpoint the server serves."""
    return LLM(str(evaluation.checkpoint), kv_cache_memory_bytes=TINY_KV_CACHE_BYTES)


def record_sent_prompts(lm: LocalCompletionsAPI) -> dict[str, list[list[int]]]:
    """Keep every token-id prompt `lm` sends to the server from now on, by request kind."""
    sent: dict[str, list[list[int]]] = {"loglikelihood": [], "generate_until": []}
    model_call = lm.model_call

    def recording_model_call(messages, *, generate: bool = True, **kwargs):
        sent["generate_until" if generate else "loglikelihood"].extend(list(prompt) for prompt in messages)
        return model_call(messages, generate=generate, **kwargs)

    lm.model_call = recording_model_call
    return sent


def encode_pair(tokenizer: PreTrainedTokenizerBase, context: str, continuation: str) -> tuple[list[int], int]:
    """The tokens lm-eval sends for a (context, continuation) request and the context's length in them, as
    `TemplateLM._encode_pair` makes them: the context's trailing spaces move to the continuation, the whole
    text is encoded once without BOS, and the continuation is what follows the context's own encoding."""
    num_spaces = len(context) - len(context.rstrip())
    if num_spaces:
        context, continuation = context[:-num_spaces], context[-num_spaces:] + continuation
    token_ids = tokenizer(context + continuation, add_special_tokens=False).input_ids
    return token_ids, len(tokenizer(context, add_special_tokens=False).input_ids)


def scored_choices(evaluation: Evaluation) -> list[ScoredChoice]:
    choices = []
    for sample in evaluation.samples(MULTIPLE_CHOICE):
        for (context, continuation), (loglikelihood, is_greedy) in zip(
            sample["arguments"], sample["filtered_resps"], strict=True
        ):
            token_ids, context_len = encode_pair(evaluation.tokenizer, context, continuation)
            choices.append(ScoredChoice(token_ids, context_len, loglikelihood, is_greedy))
    return choices


def num_documents(task: str) -> int:
    config = yaml.safe_load((DATA_DIR / TASK_FILES[task]).read_text())
    data_file = DATA_DIR / config["dataset_kwargs"]["data_files"][config["test_split"]]
    return len(data_file.read_text().splitlines())


def test_both_tasks_report_their_metrics_over_every_document(evaluation):
    results = evaluation.results["results"]
    for task, metrics in [(MULTIPLE_CHOICE, ["acc,none", "acc_norm,none"]), (GENERATE_UNTIL, ["exact_match,strip"])]:
        assert len(evaluation.samples(task)) == num_documents(task)
        for metric in metrics:
            assert 0.0 <= results[task][metric] <= 1.0, (task, metric, results[task])


def test_multiple_choice_accuracy_picks_the_likeliest_choice_by_the_servers_loglikelihoods(evaluation):
    samples = evaluation.samples(MULTIPLE_CHOICE)
    num_right = 0
    for sample in samples:
        loglikelihoods = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
        num_right += loglikelihoods.index(max(loglikelihoods)) == sample["target"]
    assert evaluation.results["results"][MULTIPLE_CHOICE]["acc,none"] == pytest.approx(num_right / len(samples))


def test_lm_eval_sends_each_choice_as_the_token_ids_of_context_and_choice(evaluation):
    """Which tokens the comparisons below sum is exact: these are the prompts the server scored."""
    choices = scored_choices(evaluation)
    assert len(choices) == sum(len(sample["arguments"]) for sample in evaluation.samples(MULTIPLE_CHOICE))
    assert sorted(evaluation.sent_prompts["loglikelihood"]) == sorted(choice.token_ids for choice in choices)
    assert all(0 < choice.context_len < len(choice.token_ids) for choice in choices)


def test_multiple_choice_loglikelihoods_match_the_offline_engines_prompt_logprobs(evaluation, offline_llm):
    choices = scored_choices(evaluation)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    outputs = offline_llm.generate([choice.token_ids for choice in choices], params)
    expected = []
    for choice, output in zip(choices, outputs, strict=True):
        assert output.prompt_logprobs[0] is None
        choice_entries = output.prompt_logprobs[choice.context_len :]
        expected.append(sum(entry.logprob for entry in choice_entries))
    assert [choice.loglikelihood for choice in choices] == pytest.approx(expected, abs=TOLERANCE)


def test_multiple_choice_loglikelihoods_and_greediness_match_hf_transformers(evaluation):
    choices = scored_choices(evaluation)
    model = AutoModelForCausalLM.from_pretrained(evaluation.checkpoint, dtype=torch.float32)
    expected = [hf_continuation_score(model, choice.token_ids, choice.context_len) for choice in choices]
    assert [choice.loglikelihood for choice in choices] == pytest.approx([ll for ll, _ in expected], abs=TOLERANCE)
    assert [choice.is_greedy for choice in choices] == [is_greedy for _, is_greedy in expected]


def hf_continuation_score(model: PreTrainedModel, token_ids: list[int], context_len: int) -> tuple[float, bool]:
    """The summed logprob of the tokens after `context_len`, and whether each is the model's argmax."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    # Row i predicts token i + 1: the rows from context_len - 1 predict the continuation.
    logprobs = torch.log_softmax(logits[context_len - 1 : -1], dim=-1)
    targets = torch.tensor(token_ids[context_len:])
    loglikelihood = logprobs.gather(-1, targets[:, None]).sum().item()
    return loglikelihood, bool((logprobs.argmax(-1) == targets).all())


def test_generate_until_answers_are_the_servers_greedy_completions(evaluation, offline_llm):
    """lm-eval sends each question's token ids (no BOS) and keeps the greedy answer up to the first newline."""
    samples = evaluation.samples(GENERATE_UNTIL)
    generation = evaluation.results["configs"][GENERATE_UNTIL]["generation_kwargs"]
    questions = [sample["arguments"][0][0] for sample in samples]
    prompts = [evaluation.tokenizer(question, add_special_tokens=False).input_ids for question in questions]
    assert sorted(evaluation.sent_prompts["generate_until"]) == sorted(prompts)
    params = SamplingParams(max_tokens=generation["max_gen_toks"], temperature=0, stop=tuple(generation["until"]))
    outputs = offline_llm.generate(prompts, params)
    assert [sample["resps"][0][0] for sample in samples] == [output.text for output in outputs]


def test_lm_eval_reads_the_models_own_greedy_continuation_as_greedy(evaluation, offline_llm):
    """No choice in the task is the random model's greedy continuation, so one is made here, and scored the way
    lm-eval scores a choice: its request, and its parser on the server's response."""
    context_ids = evaluation.sent_prompts["loglikelihood"][0]
    greedy = offline_llm.generate([context_ids], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    greedy_ids = greedy[0].token_ids
    other_ids = [*greedy_ids[:-1], (greedy_ids[-1] + 1) % len(evaluation.tokenizer)]
    scores = []
    for token_ids in (context_ids + greedy_ids, context_ids + other_ids):
        request = {"model": TINY_MODEL, "prompt": [token_ids], **LM_EVAL_SCORING}
        response = httpx.post(evaluation.completions_url, json=request, timeout=30)
        assert response.status_code == 200, response.text
        scores += LocalCompletionsAPI.parse_logprobs(response.json(), ctxlens=[len(context_ids)])
    assert [is_greedy for _, is_greedy in scores] == [True, False]
