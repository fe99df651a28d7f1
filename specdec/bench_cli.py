"""``specdec bench``: acceptance and speed of speculative decoding vs target-only and transformers."""

from __future__ import annotations

import time

import torch

DEFAULT_DRAFT = "smollm2-135m-draft"


def add_bench_parser(sub, add_model_args) -> None:
    b = sub.add_parser("bench", help="acceptance + speed report on a prompt set")
    b.add_argument("--target", default="smollm2-135m")
    b.add_argument("--draft", default=None, help="draft model, 'ngram' (default: the shipped draft, else ngram)")
    b.add_argument("--dataset", default="mtbench", help="mtbench | sharegpt | PATH.jsonl")
    b.add_argument("--num-prompts", type=int, default=None)
    b.add_argument("--max-new-tokens", type=int, default=128)
    b.add_argument("--temperature", type=float, default=0.0)
    b.add_argument("--top-p", type=float, default=1.0)
    b.add_argument("--batch-size", type=int, default=1)
    b.add_argument("--tree", default=None, help="chain:K | topk:WxD | dynamic:BUDGET (default chain:4 / ngram chain:8)")
    b.add_argument("--baseline", default="none", choices=["hf", "none"])
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--json", dest="json_out", default=None)
    b.add_argument("--plot", default=None)
    b.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    add_model_args(b)
    b.set_defaults(func=cmd_bench)


def default_draft(target: str = "smollm2-135m", device: str = "cpu") -> str:
    """The shipped draft when it is installed and ``target`` is its target, else n-gram lookup.

    On CUDA the default stays n-gram for now: the eagle draft's steps (and the verify forward that hands
    it target features) run eagerly, while n-gram speculation runs in CUDA graphs and is faster there."""
    try:
        from specdec.drafts import default_draft_available
    except ImportError:
        return "ngram"
    if str(device).startswith("cuda"):
        return "ngram"
    return DEFAULT_DRAFT if target == "smollm2-135m" and default_draft_available() else "ngram"


def cmd_bench(args) -> int:
    from specdec.bench_data import DATASET_NAMES, load_dataset
    from specdec.bench_report import build_report, environment_info, format_table, plot_report, write_json
    from specdec.cli import _device_dtype
    from specdec.cli_checks import build, check_dataset, check_model, check_positive, load
    from specdec.engine import SpecConfig, SpecEngine
    from specdec.prompts import to_prompt_ids
    from specdec.sampling_params import SamplingParams

    device, dtype = _device_dtype(args)  # every argument is checked before a model loads
    check_positive("--batch-size", args.batch_size)
    check_positive("--num-prompts", args.num_prompts, allow_none=True)
    check_dataset("--dataset", args.dataset, DATASET_NAMES)
    draft_name = args.draft or default_draft(args.target, device)
    tree = args.tree or ("chain:8" if draft_name == "ngram" else "chain:4")
    cfg = build(SpecConfig, tree=tree, device=device, dtype=dtype, attention_backend=args.attention_backend)
    params = build(SamplingParams, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                   max_new_tokens=args.max_new_tokens)
    check_model("--target", args.target)
    check_model("--draft", draft_name, extra=("ngram",))
    prompts = load_dataset(args.dataset, args.num_prompts)
    target = load("--target", args.target, dtype, device)
    draft = "ngram" if draft_name == "ngram" else load("--draft", draft_name, dtype, device, target=target)
    spec = SpecEngine(draft, target, cfg)
    plain = SpecEngine(None, target, cfg)
    ids = [to_prompt_ids(p.messages if p.messages is not None else p.prompt, target.tokenizer) for p in prompts]
    _warm_up(spec, plain, ids[0], params)
    spec_runs = _run_engine(spec, ids, params, args.batch_size, "speculative", device)
    plain_runs = _run_engine(plain, ids, params, args.batch_size, "target-only", device)
    hf_runs = hf_assisted = [None] * len(ids)
    if args.baseline == "hf":
        hf_runs, hf_assisted = _run_hf(target, draft, tree, ids, params, device)
    records = [_record(p, i, s, t, h, a, params.greedy)
               for p, i, s, t, h, a in zip(prompts, ids, spec_runs, plain_runs, hf_runs, hf_assisted)]
    config = {**vars(args), "draft": draft_name, "tree": tree, "device": device, "dtype": dtype}
    config.pop("func", None)
    report = build_report(records, environment_info(), config)
    print(format_table(report))
    if args.json_out:
        write_json(report, args.json_out)
    if args.plot:
        plot_report(report, args.plot)
    lossless = report["overall"]["lossless"]
    return 0 if lossless["identical"] == lossless["checked"] else 1


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def _warm_up(spec, plain, ids, params) -> None:
    from dataclasses import replace

    short = replace(params, max_new_tokens=min(8, params.max_new_tokens))
    spec.generate([ids], short)
    plain.generate([ids], short)


def _run_engine(engine, ids, params, batch_size, label, device) -> list[dict]:
    """Per prompt: output ids, stats and time (a batch's time is split by output tokens)."""
    from tqdm.auto import tqdm

    runs = []
    for start in tqdm(range(0, len(ids), batch_size), desc=label, unit="batch"):
        group = ids[start:start + batch_size]
        _sync(device)
        t0 = time.perf_counter()
        outs = engine.generate(group, params)
        _sync(device)
        elapsed = time.perf_counter() - t0
        total = sum(len(o.token_ids) for o in outs) or 1
        for o in outs:
            if o.error is not None:
                raise o.error
            runs.append({"token_ids": o.token_ids, "stats": o.stats, "time_s": elapsed * len(o.token_ids) / total})
    return runs


def _record(prompt, ids, spec, plain, hf, hf_assisted, greedy: bool) -> dict:
    s = spec["stats"]
    return {
        "id": prompt.id, "category": prompt.category, "prompt_tokens": len(ids), "greedy": greedy,
        "spec": {"output_tokens": len(spec["token_ids"]), "time_s": spec["time_s"], "drafted": s.drafted,
                 "accepted": s.accepted, "target_forwards": s.target_forwards,
                 "per_depth_drafted": list(s.depth_steps), "per_depth_accepted": list(s.depth_accepted),
                 "token_ids": spec["token_ids"]},
        "target_only": {"output_tokens": len(plain["token_ids"]), "time_s": plain["time_s"],
                        "token_ids": plain["token_ids"]},
        "hf": hf, "hf_assisted": hf_assisted,
    }


def to_hf_model(loaded):
    """A transformers model with the same weights as ``loaded`` (for the baselines)."""
    import transformers

    c = loaded.config
    cls_name = {"LlamaForCausalLM": "LlamaConfig", "Qwen2ForCausalLM": "Qwen2Config",
                "MistralForCausalLM": "MistralConfig"}[c.architecture]
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    hf_cfg = getattr(transformers, cls_name)(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_parameters=rope,
        max_position_embeddings=c.max_position_embeddings, tie_word_embeddings=c.tie_word_embeddings,
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids) or None,
    )
    hf_cfg.architectures = [c.architecture]
    model = getattr(transformers, c.architecture)(hf_cfg)
    model.load_state_dict(loaded.model.state_dict(), strict=False)
    return model.to(device=loaded.device, dtype=loaded.dtype).eval()


def _run_hf(target, draft, tree: str, ids, params, device):
    """transformers ``generate``: plain, and assisted (assistant model or prompt lookup)."""
    from tqdm.auto import tqdm

    from specdec.tree import template_from_spec

    hf_t = to_hf_model(target)
    kwargs = {"max_new_tokens": params.max_new_tokens, "do_sample": not params.greedy,
              "pad_token_id": target.tokenizer.eos_token_id if target.tokenizer else 0}
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p)
    assisted = ({"prompt_lookup_num_tokens": template_from_spec(tree).k} if draft == "ngram"
                else {"assistant_model": to_hf_model(draft)})
    plain_runs, assisted_runs = [], []
    for i in tqdm(ids, desc="transformers", unit="prompt"):
        x = torch.tensor([i], device=device)
        for extra, out in (({}, plain_runs), (assisted, assisted_runs)):
            _sync(device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                y = hf_t.generate(x, attention_mask=torch.ones_like(x), **kwargs, **extra)
            _sync(device)
            out.append({"output_tokens": int(y.shape[1] - x.shape[1]), "time_s": time.perf_counter() - t0})
    return plain_runs, assisted_runs


