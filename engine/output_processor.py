"""Everything about a request after a step: its tokens turned into text, stop strings, the texts of its logprobs,
and the delta each request releases.

The engine core knows tokens only. Per request, this keeps the incremental detokenizer, the stop-string filter and
what is generated but not yet released (text that may begin a stop string, or an incomplete character, with its
tokens and logprobs). A stop string ends a request here; `ProcessedOutputs.stopped` names those requests, so that
whoever drives the core finishes them there too (the server does it a step later: detokenizing runs on its event
loop, off the engine's step path, and whatever the core computed for a request meanwhile is dropped here).
"""

from dataclasses import dataclass, field

from kvserve.engine.detokenizer import IncrementalDetokenizer, StopStringFilter, special_token_ids
from kvserve.engine.outputs import RequestDelta, TokenLogprob
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.step_result import CoreOutput
from kvserve.scheduler import FinishReason

STOP, LENGTH, ABORT = FinishReason.STOP, FinishReason.LENGTH, FinishReason.ABORT


@dataclass
class _RequestState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    stop_filter: StopStringFilter
    num_tokens: int = 0
    held_token_ids: list[int] = field(default_factory=list)  # generated, not yet released
    held_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # from the core, sent with the next release
    num_cached_tokens: int | None = None  # likewise

    def release(self, request_id: str, text: str, finish_reason: FinishReason | None = None) -> RequestDelta:
        logprobs = None
        if self.params.logprobs is not None:
            logprobs, self.held_logprobs = self.held_logprobs, []
        reason = None if finish_reason is None else finish_reason.value
        stop_string = self.stop_filter.matched if finish_reason is not None else None
        delta = RequestDelta(request_id, self.held_token_ids, text, logprobs, reason, self.prompt_logprobs, stop_string,
                             self.num_cached_tokens)  # fmt: skip
        self.held_token_ids, self.prompt_logprobs, self.num_cached_tokens = [], None, None
        return delta


@dataclass(frozen=True)
class ProcessedOutputs:
    deltas: list[RequestDelta]  # one per request that released something or finished
    stopped: list[str]  # requests a stop string finished, which the core may still be running


class OutputProcessor:
    """Per-request output state, added when a request is queued and dropped when its last delta is released."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._special_token_ids = special_token_ids(tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._token_texts: dict[int, str] = {}  # each token decoded alone, for logprobs

    def add(self, request_id: str, params: SamplingParams) -> None:
        self._states[request_id] = _RequestState(
            params,
            IncrementalDetokenizer(self.tokenizer, self._special_token_ids, params.skip_special_tokens),
            StopStringFilter(params.stop),
        )

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, outputs: list[CoreOutput]) -> ProcessedOutputs:
        """One delta per request that released something: a request that got several tokens in the step (accepted
        draft tokens) gets them in one delta."""
        deltas, stopped, delta_index = [], [], {}
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:  # finished here by a stop string (or aborted) before the core heard of it
                continue
            delta = self._process(state, output)
            if delta is None:
                continue
            index = delta_index.setdefault(output.request_id, len(deltas))
            if index < len(deltas):
                deltas[index] = RequestDelta.merge([deltas[index], delta])
            else:
                deltas.append(delta)
            if delta.finished:
                del self._states[output.request_id]
                if output.finish_reason is None:
                    stopped.append(output.request_id)
        return ProcessedOutputs(deltas, stopped)

    def abort(self, request_id: str) -> RequestDelta | None:
        """Drop a request; its last delta (what it held back), or None if it is unknown or already finished."""
        state = self._states.pop(request_id, None)
        return None if state is None else state.release(request_id, state.stop_filter.flush(), ABORT)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def with_texts(self, entry: TokenLogprob) -> TokenLogprob:
        """`entry` with the text of its token and of each alternative filled in."""
        entry.token = self.token_text(entry.token_id)
        entry.top_tokens = [self.token_text(token_id) for token_id, _ in entry.top_logprobs]
        return entry

    def _process(self, state: _RequestState, output: CoreOutput) -> RequestDelta | None:
        """Detokenize the token, end the request at a stop string, and release what is certain.

        A stop token (the core's "stop") stays in the token ids but adds no text. None when nothing is released
        (text held back); a token that adds no text while nothing is held (a skipped special token) is released
        with empty text, so clients see and time every token.
        """
        request_id, params = output.request_id, state.params
        if output.embedding is not None:
            return RequestDelta(request_id, [], "", None, STOP.value, num_cached_tokens=0, embedding=output.embedding)
        state.num_tokens += 1
        state.held_token_ids.append(output.token_id)
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = [None if e is None else self.with_texts(e) for e in output.prompt_logprobs]
        if output.num_cached_tokens is not None:
            state.num_cached_tokens = output.num_cached_tokens
        if output.logprob is not None:
            state.held_logprobs.append(self.with_texts(output.logprob))
        if output.finish_reason in (STOP, ABORT):
            return state.release(request_id, state.stop_filter.flush(), output.finish_reason)
        new_text = state.detokenizer.push(output.token_id)
        # Like EOS and stop ids, stop strings only count once min_tokens tokens exist.
        text, stopped = state.stop_filter.push(new_text, can_stop=state.num_tokens >= params.min_tokens)
        if stopped:
            return state.release(request_id, text, STOP)
        if output.finish_reason == LENGTH:
            return state.release(request_id, text + state.stop_filter.flush(), LENGTH)
        if text or not (state.detokenizer.holds_text or state.stop_filter.holds_text):
            return state.release(request_id, text)
        return None
