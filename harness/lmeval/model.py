"""lm-eval's LM interface over any pwbench engine, registered with lm-eval as model "pwbench".

    pwbench lm-eval run --model pwbench --model_args engine=moe,model=DIR --tasks demo_rag ...

Log-likelihoods come from teacher-forced prompt logits (EngineRequest.return_prompt_logits),
generations from ordinary engine requests; all requests of a call go to the engine together
(in groups, so prompt logits never pile up in memory) and the engine batches them.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from engines.base import EngineError, EngineRequest, SamplingParams
from engines.common.tokenizer import load_tokenizer
from harness.calibration import create_calibrated
from harness.offline import cut_at_eos, run_offline

_GROUP = 32  # requests in flight per scoring group


@register_model("pwbench")
class PwbenchLM(LM):
    def __init__(self, engine: str = "moe", model: str | None = None, max_gen_toks: int = 64, **options: Any) -> None:
        super().__init__()
        if model is None:
            from engines.common.demo import demo_model_path

            model = str(demo_model_path())
        self.tokenizer = load_tokenizer(model)
        if self.tokenizer is None:
            raise EngineError(f"lm-eval needs text: {model} has no tokenizer.json")
        self.max_gen_toks = int(max_gen_toks)
        self.engine = create_calibrated(engine, {"model": model, **options})
        self.engine.start()
        info = self.engine.info()
        self.max_len, self.eos_ids = info.max_model_len, set(info.eos_token_ids)

    # lm-eval's own batch_size/max_batch_size/device arguments are ignored: the engine batches
    # by itself, and its device comes from model_args (device=cuda).
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> PwbenchLM:
        from lm_eval.utils import simple_parse_args_string

        return cls(**simple_parse_args_string(arg_string))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> PwbenchLM:
        return cls(**arg_dict)

    # -- helpers ---------------------------------------------------------------------------
    def _encode(self, text: str, specials: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=specials).ids

    def _prompt_logprobs(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Log-softmax of the teacher-forced logits at every position of each sequence."""
        out: list[torch.Tensor] = []
        for start in range(0, len(sequences), _GROUP):
            group = sequences[start : start + _GROUP]
            done = run_offline(self.engine, [EngineRequest(str(i), tuple(ids), 1, ignore_eos=True,
                                                           return_prompt_logits=True) for i, ids in enumerate(group)])
            out += [torch.log_softmax(done[str(i)].prompt_logits.float(), dim=-1) for i in range(len(group))]
        return out

    def _truncate(self, ids: list[int], keep_for: int = 1) -> list[int]:
        """Drop tokens from the left so that ids plus `keep_for` new tokens fit the engine."""
        room = self.max_len - keep_for
        return ids[-room:] if len(ids) > room else ids

    # -- the LM interface ------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            ctx, cont = self._encode(context, True), self._encode(continuation, False)
            pairs.append((self._truncate(ctx + cont), len(cont)))
        results = []
        for (ids, n), logprobs in zip(pairs, self._prompt_logprobs([ids for ids, _ in pairs])):
            # Row t predicts token t+1: the continuation's tokens are predicted by rows -n-1..-2.
            rows = logprobs[len(ids) - n - 1 : len(ids) - 1]
            targets = torch.tensor(ids[len(ids) - n :])
            picked = rows.gather(1, targets[:, None])[:, 0]
            results.append((float(picked.sum()), bool(torch.equal(rows.argmax(-1), targets))))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        sequences = [self._truncate(self._encode(req.args[0], True)) for req in requests]
        totals = []
        for ids, logprobs in zip(sequences, self._prompt_logprobs(sequences)):
            targets = torch.tensor(ids[1:])
            totals.append(float(logprobs[:-1].gather(1, targets[:, None]).sum()))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        stops: list[list[str]] = []
        submitted = []
        for i, req in enumerate(requests):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.get("until") or []
            stops.append([until] if isinstance(until, str) else list(until))
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            ids = self._truncate(self._encode(context, True), max_new)
            submitted.append(EngineRequest(str(i), tuple(ids), max_new, SamplingParams(temperature, seed=i)))
        done = run_offline(self.engine, submitted)
        texts = []
        for i, until in enumerate(stops):
            text = self.tokenizer.decode(cut_at_eos(done[str(i)].output_ids, self.eos_ids))
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            texts.append(text)
        return texts
