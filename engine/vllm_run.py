"""
engine/vllm_run.py: serve token-id prompts with vLLM's public offline API and write what it
did, for `python eagle3_tools.py engine-check` (which compares it with the reference).

It runs in the engine's own Python (vLLM pins its own torch and transformers) and imports
nothing of eagle3-ref:

    ENGINE_PYTHON engine/vllm_run.py REQUEST.json RESULT.json

REQUEST.json: {"target": DIR, "dtype": "float32", "prompts": [[ids], ...],
"max_new_tokens": N, "stop_token_ids": [ids], "max_model_len": M, "runs": [{"name":
"greedy"}, {"name": "eagle3", "draft": DIR, "k": 3}], "batch": 8 (0: no batched timing)}.
For each run: one engine (LLM(..., enforce_eager=True, skip_tokenizer_init=True)), each prompt
alone in order (its tokens, its share of the speculative-decoding metrics, its seconds), then
every prompt at once (seconds) when "batch" asks. Only LLM, SamplingParams, token-id prompts
and LLM.get_metrics() are used, so upstream vLLM on a GPU runs it unchanged.
"""
import gc
import json
import os
import sys
import time

from vllm import LLM, SamplingParams

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "rounds",
                "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters(llm):
    """The engine's cumulative speculative-decoding counters (zeros before any round)."""
    out = dict(rounds=0, draft_tokens=0, accepted=0, per_position=[])
    for m in llm.get_metrics():
        if m.name in SPEC_METRICS:
            out[SPEC_METRICS[m.name]] += m.value
        elif m.name == PER_POSITION:
            values = list(m.values)
            old = out["per_position"] + [0] * (len(values) - len(out["per_position"]))
            out["per_position"] = [a + b for a, b in zip(old, values)]
    return out


def difference(after, before):
    per = [a - (before["per_position"][i] if i < len(before["per_position"]) else 0)
           for i, a in enumerate(after["per_position"])]
    return dict({k: after[k] - before[k] for k in SPEC_METRICS.values()}, per_position=per)


def new_engine(request, run):
    kwargs = dict(model=request["target"], dtype=request["dtype"], enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=request["max_model_len"], seed=0,
                  disable_log_stats=False, max_num_seqs=max(1, request.get("batch") or 1))
    if run["name"] == "eagle3":
        kwargs["speculative_config"] = dict(method="eagle3", model=run["draft"],
                                            num_speculative_tokens=run["k"])
    return LLM(**kwargs)


def serve(request, run):
    t0 = time.time()
    llm = new_engine(request, run)
    loaded = time.time() - t0
    # the reference's EOS ids stop both sides alike (the engine's own EOS is ignored)
    params = SamplingParams(temperature=0.0, max_tokens=request["max_new_tokens"],
                            ignore_eos=True, stop_token_ids=request.get("stop_token_ids") or [],
                            detokenize=False)
    prompts = [dict(prompt_token_ids=ids) for ids in request["prompts"]]
    llm.generate(prompts[:1], params, use_tqdm=False)   # warm-up: first-call costs aside
    rows = []
    for prompt in prompts:
        before, t = spec_counters(llm), time.time()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        seconds = time.time() - t
        rows.append(dict(tokens=list(out.outputs[0].token_ids), seconds=seconds,
                         spec=difference(spec_counters(llm), before)))
        print(f"[{run['name']}] prompt {len(rows)}/{len(prompts)}: "
              f"{len(rows[-1]['tokens'])} tokens in {seconds:.2f} s", file=sys.stderr, flush=True)
    result = dict(name=run["name"], load_seconds=loaded, rows=rows)
    if request.get("batch"):
        t = time.time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        result["batch"] = dict(size=request["batch"], seconds=time.time() - t,
                               tokens=sum(len(o.outputs[0].token_ids) for o in outs))
    del llm
    gc.collect()
    return result


def main(request_path, result_path):
    with open(request_path) as f:
        request = json.load(f)
    import vllm
    results = dict(engine="vllm", version=vllm.__version__,
                   runs=[serve(request, run) for run in request["runs"]])
    with open(result_path + ".tmp", "w") as f:
        json.dump(results, f)
    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":   # vLLM spawns its engine processes: the guard is required
    main(*sys.argv[1:])
