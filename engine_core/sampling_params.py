"""Per-request sampling parameters: what the client asked for, validated once at construction.

The fields and their meaning follow vLLM's `SamplingParams` (and OpenAI's API for the
penalties). Bounds that depend on the model (max_tokens vs. the context length, token ids vs.
the vocabulary) are checked by the engine, which knows the model; everything else is checked
here, and a bad value raises `ValueError` naming the field and its bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from engine_core.structured_output import StructuredOutput

# Temperatures below this are treated as greedy (argmax) decoding.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_NUM_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256  # characters
MAX_NUM_LOGPROBS = 20
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0  # presence_penalty / frequency_penalty (OpenAI's range)
MIN_LOGIT_BIAS, MAX_LOGIT_BIAS = -100.0, 100.0  # OpenAI's range
MAX_NUM_LOGIT_BIAS = 1024  # entries per request (OpenAI allows 300)
# torch.Generator.manual_seed accepts exactly this range.
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token of one request, and when to stop.

    Immutable after validation. `stop` and `stop_token_ids` are stored as tuples; the
    constructor also accepts lists, and a bare string for `stop`. `logit_bias` is stored as
    (token id, bias) pairs sorted by id; the constructor also accepts a dict.
    """

    max_tokens: int = 16  # >= 1; the engine also caps it by the context length
    min_tokens: int = 0  # EOS and stop_token_ids are blocked until this many are generated
    temperature: float = 1.0  # >= 0; < GREEDY_TEMPERATURE_EPS means greedy
    top_p: float = 1.0  # in (0, 1]; 1 = disabled
    top_k: int = -1  # -1 or 0 = disabled, else >= 1
    min_p: float = 0.0  # in [0, 1]; 0 = disabled
    # > 0; 1 = disabled. Over prompt + output tokens: positive logits divided, negative multiplied.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0  # in [-2, 2]; over output tokens: logit -= penalty if seen
    frequency_penalty: float = 0.0  # in [-2, 2]; over output tokens: logit -= penalty * count
    seed: int | None = None  # None = unseeded; else reproducible sampling for this request
    stop: tuple[str, ...] = ()  # stop strings (not included in the output)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides EOS
    ignore_eos: bool = False  # keep generating past EOS (until max_tokens or a stop)
    logprobs: int | None = None  # top-n logprobs per generated token; 0 = sampled token only
    # top-n logprobs per prompt token (vLLM's), from the prefill; 0 = the prompt token only.
    # The prefill of such a request skips the prefix cache: every position is recomputed.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True  # detokenizer option
    # (token id, bias in [-100, 100]) added to the logits before every other sampling step
    # (OpenAI's logit_bias); ids >= the vocabulary size are refused by the gateway
    logit_bias: tuple[tuple[int, float], ...] = ()
    # a grammar the whole output must match (JSON schema, regex, choice, grammar): applied as
    # a token mask after logit_bias; None = unconstrained
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        # Normalise container fields first (frozen: go through object.__setattr__).
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(bias))
        self._validate()

    def _validate(self) -> None:
        for name in ("max_tokens", "min_tokens", "top_k"):
            _check_int(name, getattr(self, name))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
        ):
            _check_finite(name, getattr(self, name))

        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not MIN_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [{MIN_PENALTY}, {MAX_PENALTY}], got {value}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not MIN_SEED <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [-2**63, 2**64 - 1], got {self.seed}")
        self._validate_stops()
        self._validate_logit_bias()
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise ValueError(f"structured must be a StructuredOutput, got {self.structured!r:.80}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_NUM_LOGPROBS:
                    raise ValueError(
                        f"{name} must be None or in [0, {MAX_NUM_LOGPROBS}], got {value}")

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_NUM_STOP_STRINGS:
            raise ValueError(
                f"stop must have at most {MAX_NUM_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r}")
            if not 1 <= len(s) <= MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop strings must have 1 to {MAX_STOP_STRING_LEN} characters, "
                    f"got one of {len(s)}"
                )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id)
            if token_id < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token_id}")

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_NUM_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_NUM_LOGIT_BIAS} entries, "
                             f"got {len(self.logit_bias)}")
        for pair in self.logit_bias:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to biases, got {pair!r}")
            token_id, bias = pair
            _check_int("logit_bias", token_id)
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token_id}")
            _check_finite("logit_bias", bias)
            if not MIN_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [{MIN_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias} for token {token_id}")
        ids = [t for t, _ in self.logit_bias]
        if len(set(ids)) != len(ids):
            raise ValueError("logit_bias must name each token id once")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((t, float(b)) for t, b in self.logit_bias)))

    @property
    def is_greedy(self) -> bool:
        """True when every token is the argmax (temperature below GREEDY_TEMPERATURE_EPS)."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def all_stop_token_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """Tokens that end the request: `stop_token_ids`, plus EOS unless `ignore_eos`."""
        eos = () if self.ignore_eos else tuple(eos_token_ids)
        return frozenset(self.stop_token_ids).union(eos)


def _check_int(name: str, value: object) -> None:
    # bool is an int subclass; True as max_tokens is a caller bug, not a 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _check_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
