"""Trains kvserve's built-in default model: a ~3.8M-parameter Llama on the King James Bible (Debian's bible-kjv),
the fortune cookies of Debian's `fortunes`, and the short conversations in benchmarks/data/default_model_chat.txt,
then saves it, in bfloat16, in HF format to engine/assets/default_model/ with a model card.

    apt-get install bible-kjv fortunes fortunes-min
    .venv/bin/python -m benchmarks.train_default_model            # 11 minutes on the 2-core machine

Plain torch, one seed for everything (data order, initial weights, batches): the same machine and torch give the
same weights; other CPUs or thread counts change float rounding, so the weights differ in their last bits and the
held-out perplexity by a little (the card states this run's). Every 20th chapter and fortune is held out.
"""

import argparse
import json
import math
import random
import re
import resource
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from kvserve.testing.tiny_checkpoint import IM_END, IM_START, train_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT_FILE = REPO_ROOT / "benchmarks" / "data" / "default_model_chat.txt"
FORTUNES_DIR = Path("/usr/share/games/fortunes")
FORTUNE_FILES = (
    "fortunes", "literature", "people", "wisdom", "work", "songs-poems", "goedel", "humorists", "science",
    "men-women", "love", "food", "miscellaneous", "education", "pets", "platitudes",
)  # fmt: skip
HELD_OUT_EVERY = 20
EVAL_DIR = REPO_ROOT / "tests" / "data" / "default_model"
NEXT_VERSE_FILE = REPO_ROOT / "tests" / "data" / "lm_eval" / "kjv_next_verse.jsonl"
NEXT_VERSE_CONTEXT = 4  # verses before the one to pick
NEXT_VERSE_CHOICES = 4
VOCAB_SIZE = 4096
SEQUENCE_LEN = 256
CHAT_SHARE = 0.15  # of each batch's sequences: the conversations, oversampled so that greetings get replies
MODEL = dict(
    hidden_size=256, intermediate_size=640, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    max_position_embeddings=1024, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=True, architectures=["LlamaForCausalLM"], initializer_range=0.02,
)  # fmt: skip


def bible_chapter_verses() -> list[list[str]]:
    """Each chapter of the KJV as its verses, their numbers dropped."""
    text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    chapters: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"(\w+?\d+):\d+ (.*)", line)
        if match:
            chapters.setdefault(match.group(1), []).append(match.group(2).strip())
    return list(chapters.values())


def bible_chapters() -> list[str]:
    """Each chapter as one paragraph."""
    return [" ".join(verses) for verses in bible_chapter_verses()]


def fortunes() -> list[str]:
    found = []
    for name in FORTUNE_FILES:
        path = FORTUNES_DIR / name
        if path.exists():
            found += [entry.strip() for entry in path.read_text(errors="replace").split("\n%\n") if entry.strip()]
    return found


def conversations() -> list[str]:
    """The conversations as the chat template renders them (one user turn, one reply)."""
    rendered = []
    for block in CHAT_FILE.read_text().split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith("#")]
        if not lines:
            continue
        user = " ".join(line.removeprefix("user:").strip() for line in lines if line.startswith("user:"))
        reply = " ".join(line.removeprefix("assistant:").strip() for line in lines if line.startswith("assistant:"))
        rendered.append(f"{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n{reply}{IM_END}\n")
    return rendered


def split(documents: list[str]) -> tuple[list[str], list[str]]:
    held_out = documents[HELD_OUT_EVERY - 1 :: HELD_OUT_EVERY]
    return [d for i, d in enumerate(documents) if (i + 1) % HELD_OUT_EVERY], held_out


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    ids = []
    for document in documents:
        ids += [*tokenizer.encode(document), tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.long)


def batches(text: torch.Tensor, chat: torch.Tensor, batch_size: int, rng: torch.Generator):
    """Forever: `batch_size` windows of SEQUENCE_LEN tokens, CHAT_SHARE of them from the conversations."""
    num_chat = max(1, round(batch_size * CHAT_SHARE))
    while True:
        rows = []
        for stream, count in ((text, batch_size - num_chat), (chat, num_chat)):
            starts = torch.randint(0, len(stream) - SEQUENCE_LEN, (count,), generator=rng)
            rows += [stream[s : s + SEQUENCE_LEN] for s in starts.tolist()]
        yield torch.stack(rows)


def train(
    model: torch.nn.Module, loss_of: Callable[[torch.Tensor], torch.Tensor], data, steps: int, peak_lr: float,
    name: str = "loss",
) -> list[tuple[int, float]]:  # fmt: skip
    """`steps` batches of `data`, AdamW (betas 0.9/0.95, weight decay 0.1, gradients clipped at 1) on `loss_of` each
    batch, the learning rate on `cosine_schedule`; the loss every 50 steps (and at the last), printed and returned."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    learning_rate = cosine_schedule(peak_lr, steps)
    start_s, curve = time.monotonic(), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        loss = loss_of(next(data))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            curve.append((step, round(loss.item(), 3)))
            print(f"step {step:5d}  {name} {loss.item():.3f}  lr {learning_rate(step):.2e}  "
                  f"{time.monotonic() - start_s:6.0f} s", flush=True)  # fmt: skip
    return curve


def cosine_schedule(peak_lr: float, steps: int) -> Callable[[int], float]:
    """Each step's learning rate: a linear warm-up over the first 5% of the steps, then a cosine to a tenth."""
    warmup = max(1, steps // 20)

    def learning_rate(step: int) -> float:
        if step < warmup:
            return peak_lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    return learning_rate


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, max_windows: int = 64) -> float:
    """exp of the mean next-token loss over the first `max_windows` windows of `stream` (HF shifts the labels)."""
    model.eval()
    windows = stream[: (len(stream) // SEQUENCE_LEN) * SEQUENCE_LEN].view(-1, SEQUENCE_LEN)[:max_windows]
    losses = [model(window[None], labels=window[None]).loss for window in windows]
    model.train()
    return math.exp(torch.stack(losses).mean().item())


def next_verse_documents(held_chapters: list[list[str]], seed: int = 0) -> list[dict]:
    """lm-eval documents from held-out chapters: NEXT_VERSE_CONTEXT verses, then the true next verse among
    NEXT_VERSE_CHOICES endings. Documents come in groups from different chapters that share one set of endings,
    each ending the answer of one document of the group, so a model that ignores the context gets exactly one
    document of each group right: chance is exactly 1 / NEXT_VERSE_CHOICES, whichever endings it prefers."""
    rng = random.Random(seed)
    items = [
        (chapter, " ".join(verses[end - NEXT_VERSE_CONTEXT : end]), verses[end])
        for chapter, verses in enumerate(held_chapters)
        for end in range(NEXT_VERSE_CONTEXT, len(verses), NEXT_VERSE_CONTEXT + 1)
    ]
    rng.shuffle(items)
    groups: list[list[tuple[int, str, str]]] = []
    for item in items:  # into the first group with room, no verse of its chapter and no identical answer
        chapter, _, answer = item
        fits = (g for g in groups if len(g) < NEXT_VERSE_CHOICES and all(chapter != c and answer != a for c, _, a in g))
        group = next(fits, None)
        if group is None:
            groups.append(group := [])
        group.append(item)
    documents = []
    for group in (g for g in groups if len(g) == NEXT_VERSE_CHOICES):
        for _, context, answer in group:
            endings = [ending for _, _, ending in group]
            rng.shuffle(endings)
            documents.append({"context": context, "endings": endings, "label": endings.index(answer)})
    return documents


def write_eval_data() -> None:
    """From held-out chapters only: the sample the perplexity test and the INT8 KV benchmark score, and the
    lm-eval next-verse task's documents."""
    held_chapters = split(bible_chapter_verses())[1]
    EVAL_DIR.mkdir(parents=True, exist_ok=True)
    chapters = [" ".join(verses) for verses in held_chapters[:8]]
    (EVAL_DIR / "held_out_chapters.txt").write_text("\n".join(chapters) + "\n")
    documents = next_verse_documents(held_chapters)
    NEXT_VERSE_FILE.write_text("".join(json.dumps(document) + "\n" for document in documents))
    print(f"wrote {len(chapters)} held-out chapters to {EVAL_DIR}, {len(documents)} documents to {NEXT_VERSE_FILE}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "engine" / "assets" / "default_model")
    parser.add_argument("--eval-data-only", action="store_true", help="write the held-out test and task data and stop")
    parser.add_argument("--card-only", action="store_true", help="write the model card from training.json")
    args = parser.parse_args()
    if args.eval_data_only or args.card_only:
        write_eval_data() if args.eval_data_only else write_card(args.out)
        return
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    chapters, fortune_list, chats = bible_chapters(), fortunes(), conversations()
    train_chapters, held_chapters = split(chapters)
    train_fortunes, held_fortunes = split(fortune_list)
    corpus = "\n".join(train_chapters + train_fortunes + chats)
    tokenizer = train_tokenizer(corpus, VOCAB_SIZE)
    train_docs = train_chapters + train_fortunes
    random.Random(args.seed).shuffle(train_docs)
    text, chat = token_stream(tokenizer, train_docs), token_stream(tokenizer, chats * 4)
    held_out = token_stream(tokenizer, held_chapters + held_fortunes)
    print(f"corpus: {len(chapters)} chapters, {len(fortune_list)} fortunes, {len(chats)} conversations; "
          f"{len(text)} training tokens, {len(held_out)} held out, vocabulary {len(tokenizer)}")  # fmt: skip

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **MODEL)  # fmt: skip
    model = LlamaForCausalLM(config)
    num_parameters = sum(p.numel() for p in model.parameters())
    print(f"model: {num_parameters / 1e6:.2f}M parameters ({2 * num_parameters / 2**20:.1f} MiB in bfloat16)")
    data = batches(text, chat, args.batch_size, torch.Generator().manual_seed(args.seed))
    start_s = time.monotonic()
    # HF shifts the labels: each position predicts the next token.
    curve = train(model, lambda batch: model(batch, labels=batch).loss, data, args.steps, args.lr)
    train_minutes = (time.monotonic() - start_s) / 60
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu_minutes = (usage.ru_utime + usage.ru_stime) / 60  # wall time stretches when others share the cores
    held_out_perplexity = perplexity(model, held_out)
    print(f"trained {args.steps} steps in {train_minutes:.1f} min; held-out perplexity {held_out_perplexity:.2f}")
    save(model, tokenizer, args, num_parameters, held_out_perplexity, (train_minutes, cpu_minutes), curve, len(text))
    write_eval_data()


def save(model, tokenizer, args, num_parameters, held_out_perplexity, minutes, curve, num_tokens) -> None:
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)]
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids).save_pretrained(out)
    facts = {
        "parameters": num_parameters, "held_out_perplexity": round(held_out_perplexity, 3),
        "train_minutes": round(minutes[0], 1), "cpu_minutes": round(minutes[1], 1), "steps": args.steps,
        "batch_size": args.batch_size,
        "sequence_len": SEQUENCE_LEN, "training_tokens": num_tokens, "seed": args.seed, "loss_curve": curve,
    }  # fmt: skip
    (out / "training.json").write_text(json.dumps(facts, indent=1) + "\n")
    write_card(out)
    print(f"saved to {out}")


def write_card(out: Path) -> None:
    """The model card, README.md, from training.json."""
    facts = json.loads((out / "training.json").read_text())
    card = CARD.format(
        parameters=facts["parameters"] / 1e6, size_mib=(out / "model.safetensors").stat().st_size / 2**20,
        minutes=facts["train_minutes"], cpu_minutes=facts["cpu_minutes"], steps=facts["steps"],
        batch=facts["batch_size"], seq=facts["sequence_len"],
        tokens=facts["training_tokens"], perplexity=facts["held_out_perplexity"], seed=facts["seed"],
        vocab=VOCAB_SIZE, chat_share=round(100 * CHAT_SHARE),
    )  # fmt: skip
    (out / "README.md").write_text(card)


CARD = """# kvserve-default-kjv-v2

kvserve's built-in default model: what `kvserve serve` and `make run` serve when no model is given. A toy, to
see the whole stack work with nothing downloaded; **not an assistant**. It greets back, answers a few
dozen questions it was trained on, and otherwise writes English in the manner of the King James Bible.

- **Architecture**: Llama (`LlamaForCausalLM`), 4 layers, hidden 256, 8 attention heads over 4 KV heads, MLP
  640, tied embeddings, context 1024; {parameters:.2f}M parameters, {size_mib:.1f} MiB in bfloat16.
- **Tokenizer**: byte-level BPE of {vocab} tokens trained on the same corpus; ChatML chat template
  (`<|im_start|>` / `<|im_end|>`), BOS prepended.
- **Data**: the King James Version of the Bible (public domain; from Debian's `bible-kjv` package), the
  fortune cookies of Debian's `fortunes` package (BSD-licensed collection), and 47 short conversations written
  for this model (`benchmarks/data/default_model_chat.txt`, public domain), {chat_share}% of each batch.
  Every 20th chapter and fortune is held out. {tokens} training tokens.
- **Training**: `apt-get install bible-kjv fortunes fortunes-min; .venv/bin/python
  benchmarks/train_default_model.py` (plain torch, AdamW, lr 3e-3 with warm-up and cosine decay, {steps} steps
  of {batch} x {seq} tokens, seed {seed}) on a 2-core AMD EPYC VM (CPU, float32), saved in bfloat16:
  {minutes} minutes of wall time for the {steps} steps, {cpu_minutes} CPU-minutes (the whole script, tokenizer and
  data included, about a minute more). The loss curve is in `training.json`.
- **Held-out perplexity**: {perplexity:.2f} (float32, before the bfloat16 cast; the first 64 windows of 256 tokens
  of the held-out text, which are held-out chapters). A random model of this vocabulary is near 4,096.
- **lm-evaluation-harness**: the true next verse of a held-out chapter among four (four verses of context; 292
  documents from the 59 held-out chapters, `tests/data/lm_eval/kjv_next_verse.yaml`), through `kvserve serve`
  (`benchmarks/lm_eval_default_model.py`): 53.4% by mutual information (each ending's loglikelihood after the
  context less its loglikelihood after BOS alone; 95% interval 47.7-59.1%), where chance is 25%. By plain
  loglikelihood, 30.5% (acc) and 28.8% (acc_norm), near chance: how likely a verse is anywhere outweighs what
  the context adds to it. The model has the KJV's words, names and style, and a little of a chapter's thread.
- **Reproducing**: the same seed, machine and torch give the same weights (a rerun here wrote a byte-identical
  `model.safetensors`); another CPU or thread count rounds differently, so the weights differ in their last bits
  and the perplexity by a little.
- **Licence**: the weights are released into the public domain (CC0), as is the text they were trained on,
  except the fortunes' collection, whose BSD terms ask for attribution: this card is it.
"""


if __name__ == "__main__":
    main()
