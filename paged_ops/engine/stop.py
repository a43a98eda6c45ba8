"""Stop strings (``SamplingParams.stop``): incremental detokenization of each output and the search.

A sequence with stop strings carries a :class:`StopStrings`. After each step the engine calls
:func:`finish_on_stop_strings` on the sequences that got tokens; it decodes only what is new
(the offsets scheme of TGI and vLLM: decode a short window of recent tokens and keep the part
beyond what was already shown, holding back an incomplete multi-byte character), so a step costs
the same at token 10 and at token 10,000. A stop string is searched in the text that the new
tokens added plus the ``longest stop - 1`` characters before it, so matches that span token
boundaries are found, and tokens are fed one at a time, so with several new tokens per step
(speculative decoding) the sequence ends at the token that completed the match.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paged_ops.engine.scheduler import Scheduler
    from paged_ops.engine.scheduler import Sequence as Seq


class StopStrings:
    """The decoded output of one sequence and where a stop string ended it.

    Args:
        stops: the stop strings (non-empty).
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str``.

    ``text`` is the output decoded so far (``skip_special_tokens=True``, as ``RequestOutput.text``);
    ``stop_at`` is ``None`` until a stop string matched, then the length of the text to return
    (the text before the stop string).
    """

    def __init__(self, stops: Sequence[str], tokenizer: Any) -> None:
        self.stops, self.tokenizer = tuple(stops), tokenizer
        self.longest = max(len(s) for s in self.stops)
        self.text = ""
        self.stop_at: int | None = None
        self.num_fed = 0  # output tokens decoded so far
        self._prefix = 0  # decoding window: ids[_prefix:_read] were decoded into text already
        self._read = 0

    def feed(self, output_ids: Sequence[int]) -> int | None:
        """Decode the output tokens not fed yet, one at a time, until a stop string matches.

        Args:
            output_ids: every generated token of the sequence so far.
        Returns:
            the number of output tokens that end the sequence (up to and including the one that
            completed a stop string), or ``None`` while none matched.
        """
        while self.stop_at is None and self.num_fed < len(output_ids):
            self.num_fed += 1
            before = len(self.text)
            self._decode(output_ids[: self.num_fed])
            if len(self.text) == before:
                continue
            start = max(0, before - self.longest + 1)  # a match must end in the new text
            hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.stop_at = min(hits)  # of several, the one that starts first
                return self.num_fed
        return None

    def _decode(self, ids: Sequence[int]) -> None:
        decode = self.tokenizer.decode
        shown = decode(ids[self._prefix : self._read], skip_special_tokens=True)
        window = decode(ids[self._prefix :], skip_special_tokens=True)
        if len(window) > len(shown) and not window.endswith("\ufffd"):
            self.text += window[len(shown) :]
            self._prefix, self._read = self._read, len(ids)

    def final_text(self) -> str:
        """The text to return: cut before the stop string when one matched."""
        return self.text if self.stop_at is None else self.text[: self.stop_at]

    def visible_text(self, finished: bool) -> str:
        """The text that can be shown while streaming: all of :meth:`final_text` once finished;
        before that, without a tail that could still turn into a stop string."""
        if finished or self.stop_at is not None:
            return self.final_text()
        text = self.text
        for keep in range(min(self.longest - 1, len(text)), 0, -1):
            if any(s.startswith(text[-keep:]) for s in self.stops):
                return text[:-keep]
        return text


def finish_on_stop_strings(scheduler: Scheduler, seqs: Iterable[Seq]) -> None:
    """End each sequence of ``seqs`` whose new tokens completed a stop string.

    Its tokens after the one that completed the match are dropped (there are some only when a step
    adds several tokens), its ``finish_reason`` becomes ``"stop"`` (also when the same token
    reached the length limit) and :meth:`Scheduler.finish` frees its blocks at once.
    """
    for seq in seqs:
        if seq.stop_strings is None:
            continue
        end = seq.stop_strings.feed(seq.output_ids)
        if end is None:
            continue
        del seq.tokens[seq.prompt_len + end :]
        if seq.logprobs is not None:
            del seq.logprobs[end:]
        scheduler.finish(seq, "stop")
