"""Regenerated eagle token files: the same conversations with the target's own replies.

The tiny 4-layer target and fake ShareGPT of ``test_eagle`` (character-level tokenizer, ``<|im_end|>``
is the EOS); replies are regenerated greedily so the target alone can say what they must be.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_distill import _save_tiny_target
from test_eagle import TRAIN_ARGS, _fake_sharegpt

from specdec.cli import main
from specdec.engine import SpecConfig, SpecEngine
from specdec.loading.registry import load_model
from specdec.sampling_params import SamplingParams
from specdec.training.eagle_data import build_token_file
from specdec.training.eagle_regen import RegenConfig, assistant_runs, cut_token_file, regenerate_token_file

pytestmark = pytest.mark.usefixtures("single_thread")

NEW = 12
ENGINE = SpecConfig(max_batch_size=8, num_blocks=256, block_size=8)
REGEN = RegenConfig(max_new_tokens=NEW, temperatures=(0.0,), max_turns=2, max_docs=12, chunk=5)


def make_regen(root, n: int, max_len: int, cfg: RegenConfig):
    """The tiny target in ``root/target``, the token file ``root/text.npz`` of ``n`` fake ShareGPT conversations
    (``max_len`` tokens at most) and its regenerated file ``root/regen.npz``: (target, text, regen)."""
    _save_tiny_target(root / "target")
    _fake_sharegpt(root / "sharegpt.json", n=n)
    target = load_model(root / "target")
    text = build_token_file(root / "text.npz", target.tokenizer, "train", 10**6, max_len, root / "sharegpt.json",
                            "tiny")
    return target, text, regenerate_token_file(target, text, root / "regen.npz", cfg, ENGINE)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("regen")
    return root, *make_regen(root, 16, 200, REGEN)


def _segments(ids: np.ndarray, mask: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """Unmasked context before each assistant run, and the runs."""
    runs = assistant_runs(mask)
    starts = [0] + [b for _, b in runs[:-1]]
    return [ids[s:a].tolist() for s, (a, _) in zip(starts, runs)], [ids[a:b].tolist() for a, b in runs]


def test_masked_tokens_are_the_targets_greedy_replies(setup):
    root, target, _, regen = setup
    prompts, replies = [], []
    for i in range(regen.num_docs):
        ids, mask = regen.doc(i)
        runs = assistant_runs(mask)
        assert len(runs) == regen.meta["turns"][i] and runs[-1][1] == len(ids)  # a doc ends with a reply
        prompts += [ids[:a].tolist() for a, _ in runs]
        replies += [ids[a:b].tolist() for a, b in runs]
    outs = SpecEngine(None, target, ENGINE).generate(prompts, SamplingParams(max_new_tokens=NEW))
    assert [o.token_ids for o in outs] == replies
    assert max(regen.meta["turns"]) == 2 and regen.num_docs == 12
    assert sum(regen.meta["regenerated"]["finish"].values()) == len(replies)


def test_user_turns_are_the_sources_and_the_cut_file_has_the_same_turns(setup):
    root, target, text, regen = setup
    eos, newline = target.tokenizer.eos_token_id, target.tokenizer.encode("\n", add_special_tokens=False)
    cut = cut_token_file(text, root / "cut.npz", regen.meta["source_docs"], regen.meta["turns"])
    assert cut.meta["turns"] == regen.meta["turns"] and cut.num_docs == regen.num_docs
    for i, src in enumerate(regen.meta["source_docs"]):
        contexts, replies = _segments(*regen.doc(i))
        cut_contexts, cut_replies = _segments(*cut.doc(i))
        src_contexts, src_replies = _segments(*text.doc(src))
        assert cut_contexts == src_contexts[:len(contexts)] and cut_replies == src_replies[:len(replies)]
        assert contexts[0] == src_contexts[0]  # the first prompt, untouched
        for k in range(1, len(contexts)):
            closing = newline if replies[k - 1][-1] == eos else [eos, *newline]
            assert src_replies[k - 1][-1 - len(newline):] == [eos, *newline]  # the source's turn end
            assert contexts[k] == closing + src_contexts[k]


def test_regenerated_file_trains_with_the_eagle_trainer(setup):
    root, _, _, _ = setup
    args = [*TRAIN_ARGS]
    args[args.index("--steps") + 1] = "2"
    args[args.index("--val-docs") + 1] = "2"
    out = root / "draft"
    assert main(["distill", "--target", str(root / "target"), "--tokens", str(root / "regen.npz"), *args,
                 "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "specdec_draft.json").is_file()


def test_time_budget_stops_after_a_chunk_and_options_are_checked(setup):
    root, target, text, _ = setup
    cfg = RegenConfig(max_new_tokens=4, temperatures=(0.7,), max_docs=9, chunk=3, time_budget=1e-9)
    part = regenerate_token_file(target, text, root / "part.npz", cfg, ENGINE)
    assert part.num_docs == 3 and part.meta["regenerated"]["source_docs_considered"] == 9
    # the budget counts from ``started`` (the caller's start, loading included): 1 h, of which 1 h had passed
    import time

    cfg = RegenConfig(max_new_tokens=4, temperatures=(0.7,), max_docs=9, chunk=3, time_budget=3600.0)
    assert regenerate_token_file(target, text, root / "all.npz", cfg, ENGINE).num_docs == 9
    late = regenerate_token_file(target, text, root / "late.npz", cfg, ENGINE, started=time.perf_counter() - 3600)
    assert late.num_docs == 3
    with pytest.raises(ValueError, match="max_turns"):
        RegenConfig(max_turns=0)
    with pytest.raises(ValueError, match="top_p"):
        RegenConfig(top_p=0)
    with pytest.raises(ValueError, match="turns for conversation"):
        cut_token_file(text, root / "bad.npz", [0], [99])


def test_an_interrupted_regeneration_writes_its_finished_chunks(setup, monkeypatch):
    """SIGTERM (a time limit; the CLI turns it into KeyboardInterrupt) in the middle of the second chunk: the first
    chunk's conversations are written and marked interrupted; with no finished chunk the interrupt goes on."""
    from specdec.engine import SpecEngine

    root, target, text, _ = setup
    generate, calls = SpecEngine.generate, []

    def interrupted_after(n):
        def gen(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > n:
                raise KeyboardInterrupt
            return generate(self, *args, **kwargs)
        return gen

    cfg = RegenConfig(max_new_tokens=4, temperatures=(0.7,), max_docs=9, chunk=3)
    monkeypatch.setattr(SpecEngine, "generate", interrupted_after(1))  # chunk 1 is one turn round: then stopped
    part = regenerate_token_file(target, text, root / "cut.npz", cfg, ENGINE)
    assert part.num_docs == 3 and part.meta["regenerated"]["interrupted"] is True
    calls.clear()
    monkeypatch.setattr(SpecEngine, "generate", interrupted_after(0))
    with pytest.raises(KeyboardInterrupt):
        regenerate_token_file(target, text, root / "none.npz", cfg, ENGINE)


def test_a_reply_that_ends_itself_is_followed_by_the_newline_only():
    from specdec.training.eagle_regen import _append_reply, _Doc

    eos, nl = 2, 9
    ids = np.array([1, 5, 5, 7, 7, eos, nl, 1, 6, 8, 8, eos, nl])  # user, reply, user, reply
    mask = np.array([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=bool)
    cfg = RegenConfig(max_new_tokens=4, max_turns=2)
    for gen, closing in (([30, 31, eos], [nl]), ([30, 31, 32, 33], [eos, nl])):
        doc = _Doc(0, ids, assistant_runs(mask), [1, 5, 5], [False] * 3)
        _append_reply(doc, gen, {eos}, cfg, max_len=64)
        assert doc.out == [1, 5, 5, *gen, *closing, 1, 6] and doc.turn == 1
        assert doc.mask == [False] * 3 + [True] * len(gen) + [False] * (len(closing) + 2)
        _append_reply(doc, [40], {eos}, cfg, max_len=64)
        assert doc.turn == -1 and doc.replies == 2 and doc.out[-1] == 40
    doc = _Doc(0, ids, assistant_runs(mask), [1, 5, 5], [False] * 3)
    _append_reply(doc, [30, eos], {eos}, cfg, max_len=10)  # the next turn would not fit: finished
    assert doc.turn == -1 and doc.out == [1, 5, 5, 30, eos]


def test_a_later_run_regenerates_from_where_an_earlier_one_stopped(setup):
    """``first_doc``: a run from source conversation 5 regenerates exactly what a run over all of them wrote for
    conversations 5 on (greedy, so the replies are the same), and the two files load as one token file: the first's
    conversations, then the second's, with each file's record."""
    from specdec.training.eagle_data import load_token_files
    from specdec.training.eagle_distill import data_record

    root, target, text, _ = setup
    cfg = RegenConfig(max_new_tokens=4, temperatures=(0.0,), max_docs=9, chunk=3)
    whole = regenerate_token_file(target, text, root / "whole.npz", cfg, ENGINE)
    head = regenerate_token_file(target, text, root / "head.npz", RegenConfig(**{**vars(cfg), "max_docs": 5}), ENGINE)
    tail = regenerate_token_file(target, text, root / "tail.npz", RegenConfig(**{**vars(cfg), "first_doc": 5,
                                                                                  "max_docs": 4}), ENGINE)
    assert head.meta["source_docs"] == [d for d in whole.meta["source_docs"] if d < 5]
    assert tail.meta["source_docs"] == [d for d in whole.meta["source_docs"] if d >= 5] and tail.num_docs > 0
    both = load_token_files(f"{root / 'head.npz'}, {root / 'tail.npz'}")
    assert both.num_docs == whole.num_docs and np.array_equal(both.lengths(), whole.lengths())
    for i in range(whole.num_docs):
        assert all(np.array_equal(a, b) for a, b in zip(both.doc(i), whole.doc(i))), i
    record = data_record(both.meta)
    assert [f["num_docs"] for f in record["files"]] == [head.num_docs, tail.num_docs]
    assert load_token_files(str(root / "whole.npz")).meta == whole.meta  # one file: itself
    with pytest.raises(ValueError, match="first_doc"):
        RegenConfig(first_doc=-1)
    with pytest.raises(ValueError, match="from number 99"):
        regenerate_token_file(target, text, root / "none.npz", RegenConfig(**{**vars(cfg), "first_doc": 99}), ENGINE)
    with pytest.raises(ValueError, match="empty file name"):
        load_token_files(f"{root / 'head.npz'},")
