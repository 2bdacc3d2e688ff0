"""An example engine driver for engine-check's contract (docs/engine_check.md#the-contract),
with the EAGLE-3 reference standing in for the engine: it reads the request file, serves every
run (plain decoding, then EAGLE-3 as a chain of K or as the requested tree), and writes the
result file whole. A driver of your own engine keeps this shape and calls your engine where
this one calls eagle3_ref. engine-check runs it as

    python eagle3_engines.py engine-check ... --engine-cmd \
        "python docs/example_driver.py [--preset sglang] [--fault NAME]" --reads specforge

(argv: [options] REQUEST.json RESULT.json; exit 0 with RESULT.json written). --preset names the
acceptance rule it decodes with (default vllm); --fault plants a defect for engine-check's own
tests: "drop" reports one accepted draft fewer per prompt, "deeper" drafts one level deeper
than asked, "short" answers the first prompt only, "greedy-bonus" (sampled) takes the argmax
after a rejected draft, "no-version" leaves out a required field, "part" (greedy) emits another
token than the argmax at new token 5 of its plain run, then decodes on from it.
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import eagle3_ref as E  # noqa: E402  (the stand-in engine)


def greedy_bonus(logits, tree, g, sampling, preset):
    """A lossy rule: the vLLM chain's acceptance, but the argmax where a draft is rejected."""
    acc, draws = E.vllm_verify(logits, tree, g, sampling, preset)
    p = E.warped_probs(logits[acc.accepted], sampling)
    if acc.accepted < len(tree.tokens) - 1:
        p[int(tree.tokens[acc.accepted + 1])] = 0
    return acc._replace(bonus=int(p.argmax())), draws


def parted(target, x, n, eos):
    """Greedy decoding with new token 5 replaced by the next id, then greedy from there."""
    out = E.greedy_generate(target, x, n, eos).tolist()
    if len(out) <= 6 or out[5] in (eos or []):
        return out
    head = out[:5] + [(out[5] + 1) % target.cfg.vocab_size]
    return head + E.greedy_generate(target, torch.tensor([x[0].tolist() + head]), n - 6,
                                    eos).tolist()


def shape_of(run, fault):
    """The run's draft shape as the reference names it (a chain of K: top_k 1)."""
    if "tree" in run:
        tree = run["tree"]
        return E.TreeShape(tree["top_k"], tree["depth"] + (fault == "deeper"),
                           tree["total_tokens"])
    k = run["k"] + (fault == "deeper")
    return E.TreeShape(1, k - 1, k + 1)


def serve(request, run, target, draft, preset, fault):
    """One run: a row per prompt and sample, in order, with the counters it gained."""
    s, eos, rows = request["sampling"], request["stop_token_ids"] or None, []
    sampling = dict(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"])
    for i, ids in enumerate(request["prompts"]):
        for j in range(s["samples"]):
            x, t = torch.tensor([ids]), time.time()
            seed = i * s["samples"] + j if s["seeded"] else 1000 + i * s["samples"] + j
            if run["name"] == "plain":
                out = E.sample_generate(target, x, request["max_new_tokens"], eos_token_id=eos,
                                        seed=seed, variant=E.resolve_variant(preset),
                                        **sampling).tolist()
                if fault == "part" and s["temperature"] == 0:
                    out = parted(target, x, request["max_new_tokens"], eos)
                rows.append(dict(prompt=i, tokens=out, seconds=time.time() - t))
                continue
            shape = shape_of(run, fault)
            res = E.speculative_generate(target, draft, x, request["max_new_tokens"], tree=shape,
                                         eos_token_id=eos, variant=E.resolve_variant(preset),
                                         seed=seed, **sampling)
            depth = shape_of(run, "").depth + 1             # counters: one per asked depth
            accepted = [min(r.accepted, depth) for r in res.rounds]
            if fault == "drop" and any(accepted):   # one accepted draft fewer per prompt
                first = next(n for n, a in enumerate(accepted) if a)
                accepted[first] -= 1
            rows.append(dict(prompt=i, tokens=res.tokens.tolist(), seconds=time.time() - t,
                             spec=dict(rounds=len(accepted), per_position=[
                                 sum(a > d for a in accepted) for d in range(depth)])))
    return dict(name=run["name"], rows=rows)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="vllm", choices=list(E.PRESETS))
    parser.add_argument("--fault", default="")
    parser.add_argument("request")
    parser.add_argument("result")
    args = parser.parse_args()
    with open(args.request) as f:
        request = json.load(f)
    if args.fault == "short":
        request["prompts"] = request["prompts"][:1]
    preset = E.PRESETS[args.preset]
    if args.fault == "greedy-bonus":
        preset = preset._replace(verify=greedy_bonus)
    target = E.load_target(request["target"], dtype=E.parse_dtype(request["dtype"]))
    draft = E.load_draft(request["draft"], target)
    result = dict(engine="eagle3-ref", version="example",
                  runs=[serve(request, run, target, draft, preset, args.fault)
                        for run in request["runs"]])
    if args.fault == "no-version":
        del result["version"]
    with open(args.result + ".tmp", "w") as f:    # whole or not at all
        json.dump(result, f)
    os.replace(args.result + ".tmp", args.result)


if __name__ == "__main__":
    main()
