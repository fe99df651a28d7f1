"""Self-distillation data: the target's own responses to training prompts, cached on disk.

Prompts are the first user turns of ShareGPT *train*-split conversations (index % 20 != 0; the
eval split that ``specdec bench`` uses is never read) or the prompts of a JSONL file, rendered
with the target's chat template. Our engine runs the target alone, in large continuous batches,
to write ``response_tokens`` tokens per prompt (stopping early at EOS; the EOS is kept).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specdec.benchmark.data import BenchPrompt, load_prompt_file, load_sharegpt
from specdec.loading.base import LoadedModel

SHAREGPT_TRAIN_CATEGORY = "sharegpt-train"
CHUNK_BATCHES = 4  # prompts per generate call = CHUNK_BATCHES * gen_batch; data.pt is saved after each


@dataclass(frozen=True)
class DataSpec:
    """Everything that determines the generated data; a cached data.pt is reused only if equal."""

    target: str
    data: str
    num_prompts: int
    response_tokens: int
    max_prompt_tokens: int
    temperature: float
    seed: int
    dtype: str  # the target's dtype while generating (greedy outputs depend on it)


@dataclass
class DistillData:
    """Token ids of each example's prompt and of the target's response to it (same order)."""

    prompts: list[list[int]]
    responses: list[list[int]]
    gen_seconds: float = 0.0
    source: str = ""

    @property
    def complete(self) -> bool:
        return len(self.responses) == len(self.prompts)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(r) for r in self.responses)


def load_train_prompts(data: str, num_prompts: int) -> list[BenchPrompt]:
    """The first ``num_prompts`` training prompts of ``"sharegpt"`` (train split) or a ``.jsonl`` file."""
    if data == "sharegpt":
        return load_sharegpt("train", num_prompts)
    if data.endswith(".jsonl"):
        return load_prompt_file(data)[:num_prompts]
    raise ValueError(f"data must be 'sharegpt' or a path to a .jsonl prompt file, got {data!r}")


def describe_source(data: str, prompts: list[BenchPrompt]) -> str:
    """Where the prompts come from, for the training record."""
    if data == "sharegpt":
        return "ShareGPT V3 train split (index % 20 != 0), first user turns"
    if prompts and all(p.category == SHAREGPT_TRAIN_CATEGORY for p in prompts):
        return f"{data}: ShareGPT V3 train split (index % 20 != 0), first user turns"
    return f"prompt file {data}"


def write_prompt_file(prompts: list[BenchPrompt], path: str | Path) -> int:
    """Write ``prompts`` as a JSONL prompt file (``load_prompt_file`` format); returns the count.

    ShareGPT training prompts get category ``sharegpt-train`` so a run on the file still records
    its split (useful on a machine without the ShareGPT package).
    """
    with Path(path).open("w", encoding="utf-8") as fp:
        for p in prompts:
            category = SHAREGPT_TRAIN_CATEGORY if p.category == "sharegpt" else p.category
            fp.write(json.dumps({"id": p.id, "category": category, "messages": p.to_messages()}) + "\n")
    return len(prompts)


def prompt_token_ids(prompt: BenchPrompt, tokenizer, max_prompt_tokens: int) -> list[int]:
    """Chat-rendered ids of ``prompt`` (plain text when the tokenizer has no chat template).

    A long prompt keeps the head of its last message's content so that the whole rendered prompt,
    generation header included, fits in ``max_prompt_tokens``.
    """
    from specdec.prompts import chat_ids

    messages = prompt.to_messages()
    if not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(messages[-1]["content"]))[:max_prompt_tokens]
    ids = chat_ids(messages, tokenizer)
    if len(ids) <= max_prompt_tokens:
        return ids
    content = tokenizer.encode(messages[-1]["content"], add_special_tokens=False)
    keep = len(content) - (len(ids) - max_prompt_tokens)
    while keep > 0:  # a decode/encode round trip may add a token or two: shave again until it fits
        head = tokenizer.decode(content[:keep])
        ids = chat_ids(messages[:-1] + [{**messages[-1], "content": head}], tokenizer)
        if len(ids) <= max_prompt_tokens:
            return ids
        keep -= len(ids) - max_prompt_tokens
    raise ValueError(f"max_prompt_tokens={max_prompt_tokens} is too small for prompt {prompt.id!r}: its chat "
                     "template alone takes more tokens")


def generate_responses(target: LoadedModel, prompts: list[list[int]], spec: DataSpec, gen_batch: int,
                       device: str, dtype: str, on_chunk=None, done: list[list[int]] | None = None
                       ) -> list[list[int]]:
    """The target's responses (output ids) to ``prompts``, continuing after ``done``.

    Greedy when ``spec.temperature`` is 0, else sampled with a per-prompt seed (so chunking never
    changes the data). ``on_chunk(responses_so_far)`` is called after every chunk.
    """
    from tqdm.auto import tqdm

    from specdec.engine import SpecConfig, SpecEngine
    from specdec.sampling_params import SamplingParams

    out = list(done or [])
    # no prefix cache: distinct prompts share little beyond the template, and it needs blake3
    cfg = SpecConfig(device=device, dtype=dtype, max_batch_size=gen_batch, prefix_cache=False,
                     max_num_tokens=max(2048, 32 * gen_batch))
    engine = SpecEngine(None, target, cfg)
    chunk = CHUNK_BATCHES * gen_batch
    with tqdm(total=len(prompts), initial=len(out), desc="generate", unit="prompt") as bar:
        for start in range(len(out), len(prompts), chunk):
            ids = prompts[start:start + chunk]
            seeds = [spec.seed * 1_000_003 + start + i if spec.temperature else None for i in range(len(ids))]
            params = [SamplingParams(temperature=spec.temperature, max_new_tokens=spec.response_tokens,
                                     seed=sd) for sd in seeds]
            for o in engine.generate(ids, params):
                if o.error is not None:
                    raise o.error
                out.append(list(o.token_ids))
            bar.update(len(ids))
            if on_chunk is not None:
                on_chunk(out)
    del engine
    if str(device).startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def load_or_generate(out_dir: Path, spec: DataSpec, target: LoadedModel, gen_batch: int, device: str,
                     dtype: str, strict: bool) -> DistillData:
    """Data for ``spec``: from ``out_dir/data.pt`` when it was made with the same spec, else generated.

    A partially generated cache is continued. With ``strict`` a cache made with another spec is an
    error (a resumed run must train on its own data); otherwise it is replaced.
    """
    path = out_dir / "data.pt"
    cached = torch.load(path, weights_only=False) if path.is_file() else None
    if cached is not None and cached["spec"] != asdict(spec):
        diff = {k: (v, asdict(spec)[k]) for k, v in cached["spec"].items() if asdict(spec).get(k) != v}
        if strict:
            raise ValueError(f"{path} was generated with other options (cached, asked): {diff}; "
                             "use a new --out or drop --resume")
        print(f"distill: {path} was made with other options {diff}; regenerating")
        cached = None
    if cached is None:
        prompts = load_train_prompts(spec.data, spec.num_prompts)
        ids = [prompt_token_ids(p, target.tokenizer, spec.max_prompt_tokens) for p in prompts]
        data = DistillData(ids, [], 0.0, describe_source(spec.data, prompts))
    else:
        data = DistillData(cached["prompts"], cached["responses"], cached["gen_seconds"], cached["source"])
        print(f"distill: reusing {len(data.responses)}/{len(data.prompts)} generated responses from {path}")
    if data.complete:
        return data
    t0, base = time.perf_counter(), data.gen_seconds

    def save(responses: list[list[int]]) -> None:
        data.responses, data.gen_seconds = responses, base + time.perf_counter() - t0
        atomic_save({"spec": asdict(spec), **asdict(data)}, path)

    save(generate_responses(target, data.prompts, spec, gen_batch, device, dtype, save, data.responses))
    return data


def atomic_save(obj, path: Path) -> None:
    """Write ``obj`` with torch.save so that ``path`` is never left half-written."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)
