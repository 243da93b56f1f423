"""The sampler, on hand-made logits: greedy, top-k / top-p / min-p filters, seeds, temperature, penalties, logprobs."""

import math

import pytest
import torch

from kvserve.engine.sampler import PenaltyState, SamplingRow, argmax_rows, sample
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.structured_output import bitmask_biases

# Six tokens with known probabilities, placed at shuffled positions so no filter can rely on the index order.
PROBS = [0.40, 0.25, 0.15, 0.10, 0.06, 0.04]
POSITIONS = [3, 0, 5, 1, 4, 2]  # PROBS[i] belongs to token POSITIONS[i]
NUM_DRAWS = 400


def _known_logits() -> torch.Tensor:
    logits = torch.empty(len(PROBS))
    for prob, token in zip(PROBS, POSITIONS, strict=True):
        logits[token] = math.log(prob)
    return logits


def _tokens_with_top_probs(n: int) -> set[int]:
    return set(POSITIONS[:n])


def _row(params: SamplingParams, generator=None, prompt=(0,), output=(), vocab_size: int = 64) -> SamplingRow:
    """A row whose penalty counts (if it has penalties) hold `prompt` and `output`."""
    penalties = None
    if params.has_penalties:
        penalties = PenaltyState.of(list(prompt), vocab_size, torch.device("cpu"))
        penalties.count(torch.tensor(output, dtype=torch.long))
    return SamplingRow(params, generator, penalties)


def _draw(logits: torch.Tensor, params: SamplingParams, num_draws: int = NUM_DRAWS, seed: int = 0) -> list[int]:
    """`num_draws` independent samples from one row of logits, drawn as one batch sharing a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    batch = logits.expand(num_draws, -1).clone()
    return sample(batch, [_row(params, generator)] * num_draws).token_ids


def _greedy_choice(logits: list[float], params: SamplingParams, prompt=(), output=()) -> int:
    return sample(torch.tensor([logits]), [_row(params, None, prompt, output, len(logits))]).token_ids[0]


def test_greedy_picks_the_argmax_of_each_row():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    tokens = sample(logits, [_row(SamplingParams(temperature=0.0))] * 5)
    assert tokens.token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_top_k_never_picks_outside_the_k_largest_and_can_pick_each_of_them(top_k):
    logits = torch.randn(32, generator=torch.Generator().manual_seed(1)) * 0.3  # flat: all of the top k are likely
    allowed = set(logits.topk(top_k).indices.tolist())
    draws = _draw(logits, SamplingParams(top_k=top_k))
    assert set(draws) == allowed


@pytest.mark.parametrize("top_k", [len(PROBS), 2**63, 2**64])
def test_top_k_at_or_beyond_the_vocabulary_keeps_every_token(top_k):
    # 2**63 and up once overflowed the int64 top-k tensor and failed the whole batch's step.
    assert set(_draw(_known_logits(), SamplingParams(top_k=top_k), num_draws=2000)) == set(POSITIONS)


@pytest.mark.parametrize(
    ("top_p", "num_kept"),
    [
        (0.05, 1),  # below the top token's own mass: the top token is still kept
        (0.39, 1),
        (0.5, 2),  # 0.40 + 0.25 reaches 0.5
        (0.7, 3),  # 0.65 does not reach 0.7; adding 0.15 does
        (0.85, 4),
        (0.99, 6),
    ],
)
def test_top_p_keeps_exactly_the_smallest_set_whose_mass_reaches_p(top_p, num_kept):
    draws = _draw(_known_logits(), SamplingParams(top_p=top_p), num_draws=1000)
    assert set(draws) == _tokens_with_top_probs(num_kept)


@pytest.mark.parametrize(
    ("min_p", "num_kept"),
    [
        (0.05, 6),  # threshold 0.02
        (0.3, 3),  # threshold 0.12: 0.15 stays, 0.10 goes
        (0.5, 2),  # threshold 0.20
        (0.9, 1),
        (1.0, 1),
    ],
)
def test_min_p_excludes_tokens_less_likely_than_min_p_times_the_top_token(min_p, num_kept):
    draws = _draw(_known_logits(), SamplingParams(min_p=min_p), num_draws=1000)
    assert set(draws) == _tokens_with_top_probs(num_kept)


def test_top_p_applies_to_the_mass_that_top_k_kept():
    # Top 4 renormalised: 0.444, 0.278, 0.167, 0.111. The first two reach 0.7 there, while
    # over the full distribution (0.40 + 0.25 = 0.65) it would take three.
    draws = _draw(_known_logits(), SamplingParams(top_k=4, top_p=0.7), num_draws=1000)
    assert set(draws) == _tokens_with_top_probs(2)


@pytest.mark.parametrize(
    ("params", "num_kept"),
    [
        (SamplingParams(top_k=5, min_p=0.3), 3),  # min-p is the stricter
        (SamplingParams(top_k=2, min_p=0.3), 2),  # top-k is the stricter
        (SamplingParams(top_k=5, top_p=0.99, min_p=0.2), 4),  # 0.06 < 0.2 * 0.40
        (SamplingParams(top_k=0, top_p=0.5, min_p=0.1), 2),
    ],
)
def test_combined_filters_keep_only_what_every_filter_keeps(params, num_kept):
    draws = _draw(_known_logits(), params, num_draws=1000)
    assert set(draws) == _tokens_with_top_probs(num_kept)


def test_same_seed_gives_same_tokens_and_different_seeds_differ():
    logits = torch.zeros(1, 64)  # uniform: every draw is up to the generator
    params = SamplingParams(temperature=1.0)

    def run(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        return [sample(logits, [_row(params, generator)]).token_ids[0] for _ in range(20)]

    assert run(5) == run(5)
    assert run(5) != run(6)


def test_seeded_row_samples_the_same_tokens_alone_and_in_any_batch():
    logits = torch.randn(6, 48, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=0.8, top_p=0.95)
    companions = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=0.5, min_p=0.1),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, logprobs=3),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ]
    companion_logits = [0, 1, 3, 4, 5]

    alone_generator = torch.Generator().manual_seed(1234)
    alone = [sample(logits[2:3], [_row(seeded, alone_generator)]).token_ids[0] for _ in range(15)]

    batch_generator = torch.Generator().manual_seed(1234)
    in_batch = []
    for step in range(15):
        # Each step has other neighbours, in another number, at another position, with their own generators.
        num_before, num_companions = step % 3, 2 + step % 4
        others = [
            _row(params, None if params.is_greedy else torch.Generator().manual_seed(100 * step + i), vocab_size=48)
            for i, params in enumerate(companions[:num_companions])
        ]
        rows = [*others[:num_before], _row(seeded, batch_generator), *others[num_before:]]
        index = [*companion_logits[:num_before], 2, *companion_logits[num_before:num_companions]]
        in_batch.append(sample(logits[index], rows).token_ids[num_before])

    assert in_batch == alone
    assert len(set(alone)) > 1  # the row really samples: it is not collapsed to greedy


@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.0])
def test_sampling_frequencies_follow_the_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 0.8, -1.5, 0.0])
    expected = torch.softmax(logits / temperature, dim=-1)
    num_draws = 6000
    counts = torch.bincount(
        torch.tensor(_draw(logits, SamplingParams(temperature=temperature), num_draws)), minlength=6
    )

    expected_counts = expected * num_draws
    chi_square = (((counts - expected_counts) ** 2) / expected_counts).sum().item()
    # 5 degrees of freedom: P(chi2 > 20.5) = 0.001 under the right distribution.
    assert chi_square < 20.5
    # And the test can tell a wrong temperature apart: against softmax(logits) at another temperature it fails.
    wrong = torch.softmax(logits / (temperature * 1.5), dim=-1) * num_draws
    assert (((counts - wrong) ** 2) / wrong).sum().item() > 20.5


@pytest.mark.parametrize("temperature", [1e-2, 1e-6, 1e-30, 1e-38, 1e-45, 1e-50])
def test_a_tiny_temperature_samples_the_argmax(temperature):
    # Logits of magnitude ~20: divided naively by 1e-38 they overflow fp32.
    logits = torch.tensor([12.0, 19.5, -20.0, 19.0, 3.0])
    draws = _draw(logits, SamplingParams(temperature=temperature), num_draws=200)
    assert set(draws) == {1}


def _bracket(value: float) -> tuple[float, float]:
    return value - 1e-3, value + 1e-3


@pytest.mark.parametrize(
    ("logit", "penalty", "expected"),
    [
        (2.0, 2.0, 1.0),  # positive logits are divided
        (2.0, 1.25, 1.6),
        (-1.0, 2.0, -2.0),  # negative logits are multiplied
        (-1.0, 0.5, -0.5),  # a penalty below 1 favours repetition
        (0.0, 3.0, 0.0),
    ],
)
@pytest.mark.parametrize("seen_in", ["prompt", "output", "both"])
def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens(
    logit, penalty, expected, seen_in
):
    params = SamplingParams(temperature=0.0, repetition_penalty=penalty)
    prompt = (0, 5) if seen_in in ("prompt", "both") else (5,)
    output = (0, 0, 0) if seen_in in ("output", "both") else (5,)  # the count does not matter
    below, above = _bracket(expected)
    # Token 1 is an unseen competitor placed just below, then just above, the penalised value of token 0.
    assert _greedy_choice([logit, below, -50.0, -50.0, -50.0, -50.0], params, prompt, output) == 0
    assert _greedy_choice([logit, above, -50.0, -50.0, -50.0, -50.0], params, prompt, output) == 1


def test_repetition_penalty_leaves_unseen_tokens_alone():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # Token 0 is seen (2.0 -> 1.0); the unseen tokens keep their logits, so the larger of them wins.
    assert _greedy_choice([2.0, 1.2, 1.5], params, prompt=(0,)) == 2
    assert _greedy_choice([2.0, 1.2, 1.1], params, prompt=(0,)) == 1
    assert _greedy_choice([2.0, 0.9, 0.8], params, prompt=(0,)) == 0


@pytest.mark.parametrize(
    ("presence", "frequency", "output", "expected"),
    [
        (0.5, 0.0, (0, 0, 0), 1.5),  # presence: once, however often the token appeared
        (0.0, 0.25, (0, 0, 0), 1.25),  # frequency: once per occurrence
        (0.5, 0.25, (0, 0, 1), 1.0),
        (-1.0, 0.0, (0,), 3.0),  # negative penalties encourage repetition
        (0.0, -0.5, (0, 0), 3.0),
        (2.0, 2.0, (5,), 2.0),  # token 0 not in the output: untouched
    ],
)
def test_presence_and_frequency_penalties_subtract_from_logits_of_output_tokens(presence, frequency, output, expected):
    params = SamplingParams(temperature=0.0, presence_penalty=presence, frequency_penalty=frequency)
    below, above = _bracket(expected)
    # Token 2 is the competitor; it is never in the output.
    assert _greedy_choice([2.0, -50.0, below, -50.0, -50.0, -50.0], params, (3,), output) == 0
    assert _greedy_choice([2.0, -50.0, above, -50.0, -50.0, -50.0], params, (3,), output) == 2


def test_presence_and_frequency_penalties_ignore_prompt_tokens():
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert _greedy_choice([2.0, 1.9], params, prompt=(0, 0, 0), output=(1,)) == 0


def test_repetition_penalty_applies_before_presence_and_frequency():
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    expected = 3.0 / 2.0 - 0.5 - 2 * 0.25  # = 0.5
    below, above = _bracket(expected)
    assert _greedy_choice([3.0, below, 0.0], params, prompt=(2,), output=(0, 0)) == 0
    assert _greedy_choice([3.0, above, 0.0], params, prompt=(2,), output=(0, 0)) == 1


def test_penalties_apply_to_random_rows_too():
    # With repetition_penalty 100 the only seen token (0) falls from 5.0 to 0.05; at temperature 0.05 the
    # unseen token 1 (at 2.0) is then certain.
    params = SamplingParams(temperature=0.05, repetition_penalty=100.0)
    generator = torch.Generator().manual_seed(0)
    logits = torch.tensor([5.0, 2.0, -5.0]).expand(50, -1).clone()
    rows = [_row(params, generator, prompt=(0,), vocab_size=3)] * 50
    assert set(sample(logits, rows).token_ids) == {1}


def test_logprobs_are_the_log_softmax_of_the_raw_logits():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(3)) * 3
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    # Penalties, temperature and filters change which token is picked, never the reported logprobs.
    rows = [
        _row(SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.8), prompt=(1, 2, 3), vocab_size=40),
        _row(SamplingParams(temperature=0.3, top_k=3, logprobs=20), torch.Generator().manual_seed(0)),
        _row(
            SamplingParams(temperature=2.0, presence_penalty=1.5, logprobs=0),
            torch.Generator().manual_seed(1),
            (4,),
            (5, 5),
            vocab_size=40,
        ),
    ]
    sampled = sample(logits, rows)

    assert sorted(sampled.logprobs) == list(range(len(rows)))
    for i, row in enumerate(rows):
        token = sampled.logprobs[i]
        assert token.token_id == sampled.token_ids[i]
        assert token.logprob == pytest.approx(raw_logprobs[i, token.token_id].item(), abs=1e-6)
        num_top = row.params.logprobs
        assert len(token.top_logprobs) == num_top
        expected_values, expected_ids = raw_logprobs[i].topk(num_top) if num_top else (torch.empty(0), torch.empty(0))
        assert [token_id for token_id, _ in token.top_logprobs] == expected_ids.tolist()
        assert [value for _, value in token.top_logprobs] == pytest.approx(expected_values.tolist(), abs=1e-6)
        values = [value for _, value in token.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_top_logprobs_list_the_n_most_likely_tokens_in_order():
    logits = torch.tensor([[0.0, 3.0, -1.0, 2.0, 1.0, 2.5]])
    sampled = sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=4))])
    token = sampled.logprobs[0]
    assert sampled.token_ids == [1] and token.token_id == 1
    assert [token_id for token_id, _ in token.top_logprobs] == [1, 5, 3, 4]
    expected = torch.log_softmax(logits[0], dim=-1)[[1, 5, 3, 4]].tolist()
    assert [value for _, value in token.top_logprobs] == pytest.approx(expected)


def test_rows_without_logprobs_return_no_top_logprobs():
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(4))
    rows = [_row(SamplingParams(temperature=0.0)), _row(SamplingParams(temperature=0.0, logprobs=7))]
    sampled = sample(logits, rows)
    assert list(sampled.logprobs) == [1]  # the row without logprobs has none
    assert len(sampled.logprobs[1].top_logprobs) == 7


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100])
def test_bitmask_biases_open_exactly_the_tokens_whose_bits_are_set(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31, (3, -(-vocab_size // 32)), dtype=torch.int32, generator=generator)
    biases = bitmask_biases(bitmask, vocab_size)
    for row in range(3):
        for token in range(vocab_size):
            is_set = (int(bitmask[row, token // 32]) >> (token % 32)) & 1
            assert biases[row, token].item() == (0.0 if is_set else -math.inf)


def test_argmax_rows_equals_torchs_argmax_on_ties_and_nan():
    values = torch.randn(64, 1000, generator=torch.Generator().manual_seed(0))
    values[3, 10] = values[3, 20] = 50.0  # a tie: the first
    values[5, 7] = values[5, 9] = float("nan")  # NaN counts as the largest
    values[6, 999] = float("inf")
    assert torch.equal(argmax_rows(values), values.argmax(dim=-1))
    assert argmax_rows(values)[[3, 5, 6]].tolist() == [10, 7, 999]
