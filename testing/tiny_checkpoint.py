"""Builds small HF checkpoints from scratch: a byte-level BPE tokenizer trained offline and seeded random weights.

The built-in default model and the test checkpoints are made this way, then loaded through the
same loading code as any downloaded model.
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedConfig, PreTrainedTokenizerFast

BOS_TOKEN, EOS_TOKEN, IM_START, IM_END = "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"
# ChatML, with Hermes-style tools (as Qwen's templates): the tools in a system turn, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results in "tool" turns.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools. To call one, answer "
    '<tool_call>{"name": <name>, "arguments": <arguments>}</tool_call>\n'
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    '<tool_call>{"name": {{ call.function.name | tojson }}, "arguments": {{ call.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(corpus: str, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with BOS prepended, a ChatML-style chat template and <|eos|>/<|im_end|>."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(), trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, chat_template=CHAT_TEMPLATE
    )


def write_random_checkpoint(
    hf_config: PreTrainedConfig,
    tokenizer: PreTrainedTokenizerFast,
    out_dir: Path,
    seed: int,
    max_shard_size: str | None = None,
) -> Path:
    """Save a model with seeded random weights, its tokenizer and generation config to `out_dir`."""
    hf_config.bos_token_id = tokenizer.bos_token_id
    hf_config.eos_token_id = tokenizer.eos_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    tokenizer.save_pretrained(out_dir)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids).save_pretrained(out_dir)
    return out_dir
