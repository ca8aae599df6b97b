"""PromptIds: a request's prompt token ids, held compactly or synthesized when they are read.

A tuple of Python ints costs about 36 bytes a token (an 8-byte pointer plus a 28-byte int
object), so 20,000 RAG prompts took 2.3 GB and the whole Mooncake trace 5.6 GB before the
first request was sent. A PromptIds is an immutable sequence of ints that reads like that
tuple (len, indexing, slices as tuples, iteration, `==` and `hash` as the equal tuple, numpy
conversion) but holds either
- `stored`: a read-only numpy int32 array (4 bytes a token), or
- `deferred`: only its length and how to make it (a synthesizer and the request's skeleton):
  the tokens are synthesized when something reads them (the runner, when it sends the
  request) and kept only while the request is among the last few read (`Recent`).

Hand an engine `tuple(prompt_ids)` (one synthesis and one conversion). Pickling gives a
stored PromptIds. Imports numpy only when tokens are read.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any

RECENT_PROMPTS = 16  # deferred prompts whose tokens stay cached after being read


class Recent:
    """The last `size` deferred prompts read keep their tokens; older ones drop them again."""

    def __init__(self, size: int = RECENT_PROMPTS) -> None:
        self.size = size
        self.items: deque[PromptIds] = deque()

    def add(self, prompt: PromptIds) -> None:
        self.items.append(prompt)
        while len(self.items) > self.size:
            self.items.popleft()._array = None


class PromptIds(Sequence):
    __slots__ = ("_n", "_array", "_synthesizer", "_skeleton", "_recent")

    def __init__(self) -> None:  # use stored() or deferred()
        self._n = 0
        self._array = None
        self._synthesizer = self._skeleton = self._recent = None

    @classmethod
    def stored(cls, ids: Any) -> PromptIds:
        """Token ids (any int sequence or array) copied into a read-only int32 array (int64 if needed)."""
        import numpy as np

        array = np.asarray(ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            array = np.asarray(list(ids), dtype=np.int64)  # e.g. a tuple that numpy took for floats
        wide = array.size and (int(array.max()) > np.iinfo(np.int32).max or int(array.min()) < np.iinfo(np.int32).min)
        array = array.astype(np.int64 if wide else np.int32)  # always a copy
        array.flags.writeable = False
        prompt = cls()
        prompt._n, prompt._array = len(array), array
        return prompt

    @classmethod
    def deferred(cls, synthesizer: Any, skeleton: Any, recent: Recent) -> PromptIds:
        """`skeleton.input_tokens` ids from `synthesizer.token_ids(skeleton)` (an int array), or
        from `synthesizer.synthesize(skeleton).ids`, each time they are read (cached in `recent`)."""
        prompt = cls()
        prompt._n = skeleton.input_tokens
        prompt._synthesizer, prompt._skeleton, prompt._recent = synthesizer, skeleton, recent
        return prompt

    @property
    def deferred_tokens(self) -> bool:
        """True when the tokens are made on reading (not held)."""
        return self._synthesizer is not None

    @property
    def tokens_held(self) -> bool:
        """True while the ids are in memory (always for stored; after a read, for a while, for deferred)."""
        return self._array is not None

    def array(self):
        """The ids as a read-only 1-D numpy integer array."""
        array = self._array
        if array is None:
            import numpy as np

            make = getattr(self._synthesizer, "token_ids", None)
            array = np.asarray(make(self._skeleton) if make is not None
                               else self._synthesizer.synthesize(self._skeleton).ids)
            if array.ndim != 1 or len(array) != self._n:
                raise ValueError(
                    f"the synthesizer returned {array.shape} ids for a {self._n}-token prompt "
                    f"(request index {getattr(self._skeleton, 'index', '?')}); it must return exactly input_tokens ids"
                )
            array.flags.writeable = False
            self._array = array
            self._recent.add(self)
        return array

    def to_tuple(self) -> tuple[int, ...]:
        return tuple(self.array().tolist())

    # -- the tuple's behaviour ---------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self.array()[index].tolist())
        return int(self.array()[operator.index(index)])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array().tolist())

    def __contains__(self, value: object) -> bool:
        return value in self.to_tuple()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptIds):
            if self is other:
                return True
            import numpy as np

            return self._n == other._n and bool(np.array_equal(self.array(), other.array()))
        if isinstance(other, tuple):
            return self._n == len(other) and self.to_tuple() == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.to_tuple())  # equal to the equal tuple's hash

    def __add__(self, other: object):
        if isinstance(other, (tuple, PromptIds)):
            return self.to_tuple() + tuple(other)
        return NotImplemented

    def __radd__(self, other: object):
        if isinstance(other, tuple):
            return other + self.to_tuple()
        return NotImplemented

    def __array__(self, dtype=None, copy=None):
        array = self.array()
        if dtype is not None and array.dtype != dtype:
            return array.astype(dtype)
        return array.copy() if copy else array

    def __reduce__(self):
        return (_stored, (self.array(),))

    def __repr__(self) -> str:
        if self._array is None and self.deferred_tokens:
            return f"PromptIds({self._n} tokens, synthesized when read)"
        head = ", ".join(str(t) for t in self._array[:8].tolist())
        return f"PromptIds({self._n} tokens: {head}{', ...' if self._n > 8 else ''})"


def _stored(ids: Any) -> PromptIds:  # what a pickled PromptIds loads as
    return PromptIds.stored(ids)


def as_prompt_ids(ids: Sequence[int]) -> PromptIds:
    """A synthesizer's ids held compactly (an existing PromptIds is kept as it is)."""
    return ids if isinstance(ids, PromptIds) else PromptIds.stored(ids)
