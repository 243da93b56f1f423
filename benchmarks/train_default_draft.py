"""Trains the draft model of kvserve's built-in model (speculative decoding's `--speculative-config default`): a
one-layer Llama of ~0.7M parameters with the default model's tokenizer, distilled from the default model on the same
data (the KJV, the fortunes and the conversations, the same chapters held out), then saves it in bfloat16, in HF
format, to engine/assets/default_draft/ with a card.

    apt-get install bible-kjv fortunes fortunes-min
    .venv/bin/python -m benchmarks.train_default_draft            # 20-25 minutes on the 2-core machine (40 CPU minutes)

The loss is the KL divergence from the default model's next-token distribution (temperature 1) to the draft's, at
every position: a draft earns its keep by proposing what the target would choose, not what the text says. The
card states the share of held-out positions where the draft's greedy choice equals the target's (the chance that a
greedy draft is accepted, one token deep).
"""

import argparse
import json
import random
import resource
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from benchmarks.train_default_model import (
    SEQUENCE_LEN,
    batches,
    bible_chapters,
    conversations,
    fortunes,
    split,
    token_stream,
    train,
)
from kvserve.engine.default_model import default_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
DRAFT = dict(
    hidden_size=128, intermediate_size=384, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True, architectures=["LlamaForCausalLM"], initializer_range=0.02,
)  # fmt: skip


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) per position, averaged."""
    teacher = F.log_softmax(teacher_logits.float(), dim=-1)
    student = F.log_softmax(student_logits.float(), dim=-1)
    return F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")


@torch.no_grad()
def greedy_agreement(student, teacher, stream: torch.Tensor, max_windows: int = 32) -> float:
    """The share of positions of `stream`'s first windows where the two models' most likely next tokens agree."""
    windows = stream[: (len(stream) // SEQUENCE_LEN) * SEQUENCE_LEN].view(-1, SEQUENCE_LEN)[:max_windows]
    student.eval()
    agree = sum(
        (student(w[None]).logits.argmax(-1) == teacher(w[None]).logits.argmax(-1)).sum().item() for w in windows
    )
    student.train()
    return agree / windows.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "engine" / "assets" / "default_draft")
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    target_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    teacher = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    train_chapters, held_chapters = split(bible_chapters())
    train_fortunes, held_fortunes = split(fortunes())
    train_docs = train_chapters + train_fortunes
    random.Random(args.seed).shuffle(train_docs)
    text, chat = token_stream(tokenizer, train_docs), token_stream(tokenizer, conversations() * 4)
    held_out = token_stream(tokenizer, held_chapters + held_fortunes)

    config = LlamaConfig(vocab_size=teacher.config.vocab_size, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **DRAFT)  # fmt: skip
    student = LlamaForCausalLM(config)
    num_parameters = sum(p.numel() for p in student.parameters())
    print(f"draft: {num_parameters / 1e6:.2f}M parameters ({2 * num_parameters / 2**20:.2f} MiB in bfloat16)")
    data = batches(text, chat, args.batch_size, torch.Generator().manual_seed(args.seed))

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            teacher_logits = teacher(batch).logits
        return distillation_loss(student(batch).logits, teacher_logits)

    start_s = time.monotonic()
    curve = train(student, loss_of, data, args.steps, args.lr, name="KL")
    train_minutes = (time.monotonic() - start_s) / 60
    usage = resource.getrusage(resource.RUSAGE_SELF)
    agreement = greedy_agreement(student, teacher, held_out)
    print(f"trained {args.steps} steps in {train_minutes:.1f} min; held-out greedy agreement {agreement:.3f}")

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    student.to(torch.bfloat16).save_pretrained(out)
    facts = {
        "parameters": num_parameters, "held_out_greedy_agreement": round(agreement, 3),
        "train_minutes": round(train_minutes, 1), "cpu_minutes": round((usage.ru_utime + usage.ru_stime) / 60, 1),
        "steps": args.steps, "batch_size": args.batch_size, "sequence_len": SEQUENCE_LEN, "seed": args.seed,
        "loss_curve": curve,
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    (out / "README.md").write_text(CARD.format(**facts, size_mib=(out / "model.safetensors").stat().st_size / 2**20))
    print(f"saved to {out}")


CARD = """# kvserve-default-kjv-v2-draft

The draft model of kvserve's built-in model (kvserve-default-kjv-v2), for speculative decoding:
`kvserve serve --speculative-config default`. A one-layer Llama (hidden size 128, 4 heads, 2 KV heads, tied
embeddings) of {parameters} parameters ({size_mib:.2f} MiB in bfloat16) that uses the default model's tokenizer
(it ships none of its own).

Distilled from the default model ({steps} steps of {batch_size} windows of {sequence_len} tokens, KL divergence from
its next-token distributions, seed {seed}) on the same training data; {train_minutes} minutes on a 2-core CPU.
On the held-out chapters and fortunes its greedy next token equals the default model's at
{held_out_greedy_agreement:.1%} of positions. Made by `benchmarks/train_default_draft.py`.
"""

if __name__ == "__main__":
    main()
