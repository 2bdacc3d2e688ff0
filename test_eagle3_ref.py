"""The eagle3-ref test suite: each property of SPEC.md, checked against an independent
computation -- transformers' own model, a brute-force enumeration, or a tree worked out by
hand in the test -- never against the function's own output.

    python -m pytest -q test_eagle3_ref.py

Every model is a tiny random one (no downloads), built by the scaffold both test files
share (test_eagle3_scaffold.py). The tensor-parallel tests run this same file as the
torchrun worker (run_workers):

    python -m torch.distributed.run --standalone --nproc_per_node=2 test_eagle3_ref.py WORKER DIR
"""
import ast
import functools
import inspect
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import stat
import subprocess
import sys
import warnings
from collections import Counter
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from scipy.stats import chisquare
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import eagle3_ref as E
from test_eagle3_scaffold import (
    ATOL, DS_TARGETS, DS_TINY, HIDDEN, LAYERS, REF_CLI, TARGETS, TINY, TRAIN_AUX, TRAIN_CHATS,
    TRAIN_GEN_PROMPT, TRAIN_TINY, VOCAB, ZOO, assert_close, bad_inputs, built_once, chat_data,
    check_bad_input, check_path_flag, children, cli, cli_env, cli_here, cli_path_flags,
    draft_config, edit_draft_dir, finish, grow, hf_aux, hf_forward, hf_greedy, hf_warped_probs,
    inverse_cdf, last_json, path_to, pick, random_prompt, random_tree, refused,
    reply_token_counts, run_cli, sent, sharpen, shift_left, tiny_draft, tiny_model,
    train_chat_prompt_ids, train_chat_target, train_config, train_conversations, train_draft,
    train_generate_setup, train_render, train_step, train_top_ids, ttt_batch, verify, zoo)


# ========================================================================================
# SPEC 3. the target model and tensor parallelism
# ========================================================================================


# ----------------------------------------------------------------------------------------
# logits, aux features and greedy decoding equal transformers'


@pytest.mark.parametrize("name", TARGETS)
def test_target_logits_aux_features_and_greedy_decoding_equal_transformers(zoo, name):
    # the aux features are the residuals entering layers 2, L//2 and L-3
    ids = random_prompt(1, length=40)
    ref_logits, hidden_states = hf_forward(zoo.hf(name), ids)
    logits, aux = zoo.target(name)(ids)
    assert logits.shape == (1, 40, VOCAB) and aux.shape == (1, 40, 3 * HIDDEN)
    assert (logits[0] - ref_logits).abs().max() <= ATOL
    assert_close(aux[0], hf_aux(hidden_states, (2, LAYERS // 2, LAYERS - 3)))
    ids = random_prompt(5)
    expected = hf_greedy(zoo.hf(name), ids, 40)
    assert len(set(expected[10:].tolist())) >= 3, "degenerate test model: constant text"
    assert E.greedy_generate(zoo.target(name), ids, 40).tolist() == expected.tolist()
    # recorded, the row that chose token i is transformers' last-position logits after
    # token i - 1 (fp32 round-off), and its argmax
    tokens, logits = E.greedy_generate(zoo.target(name), ids, 40, record_logits=True)
    assert torch.equal(tokens, expected)
    assert logits.shape == (len(tokens), VOCAB) and logits.dtype == torch.float32
    full, _ = hf_forward(zoo.hf(name), torch.cat([ids, tokens[None, :-1]], 1))
    assert_close(logits, full[ids.shape[1] - 1:], "greedy logits")
    assert logits.argmax(-1).tolist() == tokens.tolist()


@pytest.mark.parametrize("name, layout", [("qwen2", "sharded"), ("llama", "pytorch_model.bin")])
def test_sharded_and_bin_checkpoints_load_like_transformers(zoo, tmp_path, name, layout):
    model = zoo.hf(name)
    if layout == "sharded":
        model.save_pretrained(tmp_path, max_shard_size="100KB")
        assert (tmp_path / "model.safetensors.index.json").exists()
        assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    else:  # transformers 5 always writes safetensors: the .bin as older checkpoints have it
        model.config.save_pretrained(tmp_path)
        torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    ids = random_prompt(3, length=16)
    ref_logits, _ = hf_forward(model, ids)
    logits, _ = E.load_target(str(tmp_path))(ids)
    assert (logits[0] - ref_logits).abs().max() <= ATOL


# ----------------------------------------------------------------------------------------
# the KV cache: tree verification and commit


def verified_tree(target, seed):
    """A random 10-token prefix prefilled, then a random tree verified after it; `sequences`:
    each node's prefix + root-to-node tokens, what transformers scores for it."""
    prefix, (tokens, parents) = random_prompt(seed, length=10), random_tree(seed + 1)
    cache = target.new_cache(64)
    target(prefix, cache=cache)
    logits, aux = verify(target, cache, 10, E.tree_from_parents(tokens, torch.tensor(parents)))
    sequences = [torch.cat([prefix[0], tokens[path_to(parents, i)]])[None]
                 for i in range(len(tokens))]
    return SimpleNamespace(prefix=prefix, tokens=tokens, parents=parents, cache=cache,
                           logits=logits, aux=aux, sequences=sequences)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_verify_tree_gives_each_node_the_logits_and_features_of_its_path(zoo, name):
    v = verified_tree(zoo.target(name), 6)
    assert max(len(ids[0]) for ids in v.sequences) >= 10 + 4, "tree too shallow"
    for node, ids in enumerate(v.sequences):
        ref_logits, hidden_states = hf_forward(zoo.hf(name), ids)
        assert (v.logits[node] - ref_logits[-1]).abs().max() <= ATOL, f"node {node}"
        assert_close(v.aux[node], hf_aux(hidden_states, (2, 4, 5))[-1], f"node {node}")


def test_commit_then_decode_equals_recompute_from_scratch(zoo):
    target = zoo.target("llama")
    v = verified_tree(target, 8)
    path = max((path_to(v.parents, i) for i in range(len(v.parents))), key=len)  # deepest node
    assert path != list(range(len(path))), "path must need a gather, not be the first nodes"
    n = E.commit(v.cache, 10, torch.tensor(path))
    assert n == 10 + len(path)
    seq = torch.cat([v.prefix[0], v.tokens[path]])
    for step, token in enumerate([3, 17, 11]):  # decode three more tokens on the cache
        seq = torch.cat([seq, torch.tensor([token])])
        logits, _ = target(torch.tensor([[token]]), cache=v.cache, start=n + step)
        ref_logits, _ = hf_forward(zoo.hf("llama"), seq[None])
        assert (logits[0, -1] - ref_logits[-1]).abs().max() <= ATOL, f"step {step}"


# ========================================================================================
# SPEC 3 (continued): the DeepSeek-V3 / Kimi-K2 family (MLA + MoE) against transformers' DeepseekV3ForCausalLM
# ========================================================================================

DS_FP8_BLOCK = [32, 32]  # blocks straddle the W = 2 slices of q_b, kv_b and the experts
MIN_ROUTING_GAP = 2e-5   # 20x the fp32 round-off of a router score between implementations


def routing_gap(hf, ids):
    """Smallest margin over MoE layers and tokens of the last kept over the first dropped expert."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    gaps = []

    def hook(router, inputs, _):
        x = inputs[0].reshape(-1, router.hidden_dim).float()
        biased = torch.sigmoid(x @ router.weight.float().T) + router.e_score_correction_bias
        G, kept = router.num_group, router.topk_group
        group = biased.view(len(biased), G, -1).topk(2, -1).values.sum(-1)
        ranked = group.sort(-1, descending=True).values
        if kept < G:
            gaps.append(float((ranked[:, kept - 1] - ranked[:, kept]).min()))
        allowed = torch.zeros_like(group, dtype=torch.bool).scatter(
            1, group.topk(kept, -1).indices, True).repeat_interleave(biased.shape[1] // G, 1)
        s = biased.masked_fill(~allowed, -math.inf).sort(-1, descending=True).values
        gaps.append(float((s[:, router.top_k - 1] - s[:, router.top_k]).min()))

    handles = [m.register_forward_hook(hook) for m in hf.modules()
               if isinstance(m, DeepseekV3TopkRouter)]
    with torch.no_grad():
        hf(ids)
    for h in handles:
        h.remove()
    return min(gaps)


def assert_routing_is_robust(hf, ids):
    gap = routing_gap(hf, ids)
    assert gap > MIN_ROUTING_GAP, f"routing near-tie (gap {gap:.2e}): pick another seed/prompt"


def test_deepseek_softmax_scale_and_latent_eps_are_transformers(zoo):
    # (dn + dr)^-0.5 * (0.1 * mscale_all_dim * ln(factor) + 1)^2, and 1e-6 for the latent
    # norms although rms_norm_eps is 1e-5
    mla = zoo.target("ds-v3").cfg.mla
    assert mla.softmax_scale == pytest.approx(24 ** -0.5 * (0.1 * 0.707 * math.log(4.0) + 1) ** 2)
    assert mla.latent_eps == 1e-6 and zoo.target("ds-v3").cfg.rms_eps == 1e-5


@pytest.mark.parametrize("name", DS_TARGETS)
def test_deepseek_logits_aux_cache_of_the_latent_and_tree_nodes_equal_transformers(zoo, name):
    hf, target = zoo.hf(name), zoo.target(name)
    ids = random_prompt(40, length=16)
    assert_routing_is_robust(hf, ids)
    logits, hidden_states = hf_forward(hf, ids)
    ours_logits, ours_aux = target(ids)
    assert_close(ours_logits[0], logits, "logits")
    assert_close(ours_aux[0], hf_aux(hidden_states, (2, LAYERS // 2, LAYERS - 3)), "aux")
    cfg, v = target.cfg.mla, verified_tree(target, 41)
    assert isinstance(v.cache, E.LatentCache)              # r + dr values per token and layer
    assert v.cache.latent.shape == (LAYERS, 1, 1, 64, cfg.kv_lora_rank)
    assert v.cache.k_pe.shape == (LAYERS, 1, 1, 64, cfg.qk_rope_head_dim)
    for node, sequence in enumerate(v.sequences):
        assert_routing_is_robust(hf, sequence)
        assert_close(v.logits[node], hf_forward(hf, sequence)[0][-1], f"node {node}")


def ds_quantise(w, block):
    """DeepSeek-V3's FP8 e4m3 blocks (scale_inv = amax / 448) -> (fp8, scale_inv, dequantised)."""
    b0, b1 = block
    rows, cols = -(-w.shape[0] // b0), -(-w.shape[1] // b1)
    scale = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].abs().max() / 448.0
    full = scale.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:w.shape[0], :w.shape[1]]
    fp8 = (w / full).to(torch.float8_e4m3fn)
    return fp8, scale, fp8.float() * full


def ds_fp8_dir(hf, root):
    """`hf`'s checkpoint, 2-D weights but the router in FP8, beside it the dequantised one."""
    dequantised = {}

    def quantise(state):
        for key in [k for k in state if k.startswith("model.layers.") and state[k].dim() == 2
                    and not k.endswith("mlp.gate.weight")]:
            state[key], state[key + "_scale_inv"], dequantised[key] = ds_quantise(state[key],
                                                                                  DS_FP8_BLOCK)
    hf.save_pretrained(root)
    edit_draft_dir(root, state=quantise, config=lambda c: c.update(quantization_config=dict(
        quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
        weight_block_size=DS_FP8_BLOCK)))
    reference_dir = root.parent / (root.name + "-dequantised")
    hf.save_pretrained(reference_dir)
    return edit_draft_dir(reference_dir, state=lambda plain: plain.update(dequantised))


@pytest.fixture(scope="module")
def ds_fp8(zoo, tmp_path_factory):
    from transformers import DeepseekV3ForCausalLM
    root = tmp_path_factory.mktemp("fp8") / "ds-v3"
    reference_dir = ds_fp8_dir(zoo.hf("ds-v3"), root)
    reference = DeepseekV3ForCausalLM.from_pretrained(reference_dir).eval()
    reference.set_attn_implementation("eager")
    reference.set_experts_implementation("eager")
    return SimpleNamespace(dir=str(root), reference=reference)


def test_fp8_checkpoint_loads_to_the_dequantised_model_at_world_size_1_and_2(ds_fp8, ds_tp_run):
    with safe_open(os.path.join(ds_fp8.dir, "model.safetensors"), framework="pt") as f:
        assert f.get_tensor("model.layers.3.mlp.experts.1.up_proj.weight").dtype == \
            torch.float8_e4m3fn
    ids = random_prompt(43, length=12)
    assert_routing_is_robust(ds_fp8.reference, ids)
    assert_close(E.load_target(ds_fp8.dir)(ids)[0][0], hf_forward(ds_fp8.reference, ids)[0],
                 "fp8 logits")
    reference = hf_forward(ds_fp8.reference, ds_tp_run.job["prompt"])[0]
    for rank in ds_tp_run.ranks:
        assert_close(rank["fp8_logits"][0], reference, "fp8 logits at W = 2")


def ds_rewrite_dir(src, dst, config_edit, prefix="", extra=None):
    """A copy of an HF dir with its config.json rewritten, `prefix` before each weight name."""
    shutil.copytree(src, dst)
    return edit_draft_dir(dst, config=config_edit, state=lambda state: dict(
        {prefix + k: v for k, v in state.items()}, **(extra or {})))


def kimi_k2_config(config):
    """What moonshotai ships: model_type kimi_k2 with remote-code auto_map entries."""
    return dict(config, model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"],
                auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                          "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"})


def kimi_k25_wrapper(config):
    return dict(model_type="kimi_k25", architectures=["KimiK25ForConditionalGeneration"],
                text_config=kimi_k2_config(config), vision_config=dict(hidden_size=8))


MTP = {f"model.layers.{LAYERS}.eh_proj.weight": torch.zeros(HIDDEN, 2 * HIDDEN),
       f"model.layers.{LAYERS}.enorm.weight": torch.ones(HIDDEN)}
VISION = {"vision_tower.patch_embed.weight": torch.zeros(8, 3),
          "mm_projector.proj.weight": torch.zeros(4, 8)}


@pytest.mark.parametrize("name, source, edit, prefix, extra, says", [
    ("kimi_k2", "kimi", kimi_k2_config, "", None, ""),            # without remote code
    ("kimi_k25", "kimi", kimi_k25_wrapper, "language_model.", VISION,
     "ignoring 2 non-text weights"),                                # its text model
    ("mtp", "ds-v3", lambda c: dict(c, num_nextn_predict_layers=1), "", MTP,
     f"ignoring 2 MTP layer model.layers.{LAYERS}.* weights"),      # MTP layers skipped
])
def test_deepseek_family_dirs_as_shipped_load_as_transformers_model(
        zoo, tmp_path, capsys, name, source, edit, prefix, extra, says):
    ds_rewrite_dir(zoo.dir(source), tmp_path / name, edit, prefix, extra)
    ids = random_prompt(44, length=12)
    target = E.load_target(str(tmp_path / name))
    assert says in capsys.readouterr().err
    assert_close(target(ids)[0][0], hf_forward(zoo.hf(source), ids)[0], f"{name} logits")
    assert name != "mtp" or torch.equal(target(ids)[0], zoo.target(source)(ids)[0])


DS_ROPE_CASE = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                    v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                    n_group=1, topk_group=1, first_k_dense_replace=4, moe_intermediate_size=16)


def test_deepseek_rope_interleave_follows_the_config_as_transformers(tmp_path):
    # DeepSeek's checkpoints pair rope dims at (2i, 2i+1) (rope_interleave: true, the
    # default); a config with false pairs the halves, and transformers then skips the
    # de-interleave. Same weights, both flags: each equals transformers, and they differ.
    ids = random_prompt(5)
    logits = {}
    for interleave in (True, False):
        hf = tiny_model("deepseek_v3", 3, 0.2, **DS_ROPE_CASE, rope_interleave=interleave)
        hf.save_pretrained(tmp_path / str(interleave))
        assert_routing_is_robust(hf, ids)
        logits[interleave] = E.load_target(str(tmp_path / str(interleave)))(ids)[0]
        assert_close(logits[interleave], hf_forward(hf, ids)[0], f"rope_interleave={interleave}")
    assert float((logits[True] - logits[False]).abs().max()) > 1e-2


# ========================================================================================
# SPEC 3 (continued): tensor parallelism: torchrun --nproc_per_node=2 (gloo) equals one process
# ========================================================================================

def run_workers(worker, job, root, timeout=600, world=2):
    """`worker(job, rank)` of this file on `world` torchrun ranks (gloo) -> each rank's result."""
    torch.save(job, root / "job.pt")
    proc = finish(cli(worker.__name__, root, world=world, script=__file__), timeout=timeout)[0]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(root / f"rank{r}.pt") for r in range(world)]


TP_TARGETS = ("llama", "qwen2", "qwen3")         # GQA; sharded biases; q/k norms, head_dim 24
TP_SHAPES = [(1, 3, 5), (3, 3, 12), (4, 2, 20)]  # speculative trees run under torchrun
TP_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def tp_run(zoo, speculation, vocab6_checkpoint, tmp_path_factory):
    """One torchrun launch with 2 ranks; returns each rank's results."""
    prompt = random_prompt(21, length=10)

    def build(root):
        job = dict(prompt=prompt, new_tokens=TP_NEW_TOKENS, shapes=TP_SHAPES, targets=[],
                   vocab6=vocab6_checkpoint[0])
        for name in TP_TARGETS:
            draft_dir = str(root / f"draft-{name}")
            E.save_draft(speculation[name].draft, draft_dir)
            job["targets"].append(dict(name=name, dir=zoo.dir(name), draft=draft_dir,
                                       spec_prompt=speculation[name].prompts["memorized"]))
        return run_workers(tp_worker, job, root)
    return SimpleNamespace(prompt=prompt, ranks=built_once(tmp_path_factory, "tp", build))


COMM_TREE = (3, 2, 9)  # the tree whose verify forward the TP workers count


def plain_comm(tally):
    """{op: (calls, bytes)} of a Tally, as plain Python."""
    return {op: (tally.calls[op], tally.bytes[op]) for op in ("all_reduce", "broadcast")}


def comm_of_runs(target, draft, prompt, spec_prompt):
    """Collectives of a COMM_TREE verify forward, a speculative run by phase, plain greedy."""
    cache = target.new_cache(prompt.shape[1] + COMM_TREE[2])
    target(prompt, cache=cache)
    tokens, parents = random_tree(77, n_nodes=COMM_TREE[2])
    tree = E.tree_from_parents(tokens, torch.tensor(parents))
    _, verified = sent(target, lambda: verify(target, cache, prompt.shape[1], tree))
    spec = E.speculative_generate(target, draft, spec_prompt, 16, tree=E.TreeShape(*COMM_TREE))
    _, greedy = sent(target, lambda: E.greedy_generate(target, spec_prompt, 16))
    stats = E.measure_decoding(target, draft, [spec_prompt], 16, tree=E.TreeShape(*COMM_TREE),
                               repeats=1)           # bench's all-reduces per token
    return dict(verify=plain_comm(verified), prefill=plain_comm(spec.prefill_comm),
                rounds=[dict(plain_comm(r.comm), nodes=len(r.tree.tokens)) for r in spec.rounds],
                greedy=plain_comm(greedy), tokens=len(spec.tokens),
                per_token=(stats.spec_allreduce, stats.greedy_allreduce))


def assert_comm_counts(comm, cfg, spec_prompt_length, elt=4):
    """By hand: 2 all-reduces of T x D a layer and forward; 1 broadcast a token, N + 2 a round."""
    L, D, N = cfg.n_layers, cfg.hidden_size, COMM_TREE[2]
    assert comm["verify"] == dict(all_reduce=(2 * L, 2 * L * N * D * elt), broadcast=(0, 0))
    T = spec_prompt_length
    assert comm["prefill"] == dict(all_reduce=(2 * L, 2 * L * T * D * elt), broadcast=(1, 8))
    assert comm["rounds"], "no speculation round ran"
    for r in comm["rounds"]:   # the verify's all-reduces; the decision's one broadcast
        assert r["all_reduce"] == (2 * L, 2 * L * r["nodes"] * D * elt)
        assert r["broadcast"] == (1, (r["nodes"] + 2) * 8)
    # greedy: the prefill of T tokens, then 15 forwards of one token; 16 decisions
    assert comm["greedy"] == dict(all_reduce=(2 * L * 16, 2 * L * (T + 15) * D * elt),
                                  broadcast=(16, 16 * 8))
    # measure_decoding's (calls, bytes) per token: those all-reduces over the 16 tokens
    spec = [sum(p["all_reduce"][i] for p in [comm["prefill"], *comm["rounds"]]) for i in (0, 1)]
    assert comm["tokens"] == 16 and comm["per_token"] == (
        (spec[0] / 16, spec[1] / 16), tuple(x / 16 for x in comm["greedy"]["all_reduce"]))


def tp_speculative(target, draft, prompt, shapes, n=TP_NEW_TOKENS):
    """(tokens, accept lengths) of a speculative run with each tree shape."""
    return [(r.tokens, r.accept_lengths) for r in (E.speculative_generate(
        target, draft, prompt, n, tree=E.TreeShape(*shape)) for shape in shapes)]


def tp_batches(target, draft):
    """{(preset, temperature): each row's tokens} of BATCH_PROMPTS in one batch."""
    return {(preset, t): [r.tokens.tolist() for r in E.speculative_generate_batch(
        target, draft, BATCH_PROMPTS, 16, temperature=t, tree=E.TreeShape(2, 2, 7), seed=5,
        variant=E.resolve_variant(preset))] for preset in E.PRESETS for t in (0.0, 0.9)}


def tp_worker(job, rank):
    """On every rank: each target sharded over 2 ranks; forward, greedy and speculative."""
    results = dict(world=E.world_info()[1])
    for case in job["targets"]:
        target = E.load_target(case["dir"])
        draft = E.load_draft(case["draft"], target)
        layer = target.model.layers[0]
        logits, aux = target(job["prompt"])
        results[case["name"]] = dict(
            logits=logits, aux=aux,
            slices=dict(q=layer.self_attn.q_proj.weight.clone(),
                        o=layer.self_attn.o_proj.weight.clone(),
                        down=layer.mlp.down_proj.weight.clone()),
            greedy=E.greedy_generate(target, job["prompt"], job["new_tokens"]),
            speculative=tp_speculative(target, draft, case["spec_prompt"], job["shapes"]),
            comm=comm_of_runs(target, draft, job["prompt"], case["spec_prompt"]))
    case = job["targets"][0]                           # batches under each preset
    target = E.load_target(case["dir"])
    draft = E.load_draft(case["draft"], target)
    results["batch"] = tp_batches(target, draft)
    # Rank 1 now gets another (untied) lm_head, so its own argmax disagrees with rank 0's:
    # every rank must still emit rank 0's decisions (ranks deciding alone diverge or deadlock).
    if rank == 1:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            target.lm_head.weight.add_(torch.randn(target.lm_head.weight.shape, generator=g) * 2)
    greedy = E.greedy_generate(target, case["spec_prompt"], job["new_tokens"])
    results["rank1_disagrees"] = dict(
        logits=target(torch.cat([case["spec_prompt"], greedy[None]], dim=1))[0], greedy=greedy,
        speculative=tp_speculative(target, draft, case["spec_prompt"], job["shapes"]))
    results["sampled"] = sampled_on_rank(job["vocab6"], rank)
    return results


@pytest.mark.parametrize("name", TP_TARGETS)
def test_tensor_parallel_equals_one_process_shards_and_counts_its_collectives(
        speculation, tp_run, name):
    s, layer = speculation[name], speculation[name].hf.model.layers[0]
    full = {"q": (layer.self_attn.q_proj.weight, 0),         # column-parallel
            "o": (layer.self_attn.o_proj.weight, 1),         # row-parallel
            "down": (layer.mlp.down_proj.weight, 1)}
    logits, aux = s.target(tp_run.prompt)
    greedy = hf_greedy(s.hf, tp_run.prompt, TP_NEW_TOKENS).tolist()
    assert E.greedy_generate(s.target, tp_run.prompt, TP_NEW_TOKENS).tolist() == greedy
    one = tp_speculative(s.target, s.draft, s.prompts["memorized"], TP_SHAPES)
    expected = s.reference["memorized"][:TP_NEW_TOKENS].tolist()
    for r, rank in enumerate(tp_run.ranks):
        assert rank["world"] == 2
        # the all_reduce sums partial results in another order: fp32 round-off only
        assert_close(rank[name]["logits"], logits, name)
        assert_close(rank[name]["aux"], aux, name)
        assert rank[name]["greedy"].tolist() == greedy
        for shape, (tokens, accepts), (tokens1, accepts1) in zip(
                TP_SHAPES, rank[name]["speculative"], one):
            assert tokens.tolist() == tokens1.tolist() == expected, (r, shape)
            assert accepts == accepts1, (r, shape)
        for key, (weight, dim) in full.items():
            assert torch.equal(rank[name]["slices"][key], weight.detach().chunk(2, dim)[r]), key
        assert_comm_counts(rank[name]["comm"], s.target.cfg, s.prompts["memorized"].shape[1])
    assert torch.equal(tp_run.ranks[0][name]["logits"], tp_run.ranks[1][name]["logits"])
    if SPEC_TARGETS[name]["sharpen"]:   # the drafter learnt the text: rounds accept 2 drafts
        assert max(max(accepts) for _, accepts in one) >= 3, "no round accepted two drafts"
    comm = comm_of_runs(s.target, s.draft, tp_run.prompt, s.prompts["memorized"])  # at W = 1
    phases = [comm["verify"], comm["prefill"], comm["greedy"], *comm["rounds"]]
    assert comm["rounds"] and all(phase[op] == (0, 0) for phase in phases
                                  for op in ("all_reduce", "broadcast")), "W = 1 sent something"


def test_tensor_parallel_batches_equal_single_process(speculation, tp_run):
    s = speculation[TP_TARGETS[0]]
    expected = tp_batches(s.target, s.draft)           # each preset, greedy and sampled
    for rank in tp_run.ranks:
        assert rank["batch"] == expected


@pytest.fixture(scope="module")
def ds_tp_run(zoo, ds_speculation, ds_fp8, tmp_path_factory):
    job = dict(prompt=random_prompt(47, length=12), fp8=ds_fp8.dir, targets=[])

    def build(root):
        for name, s in ds_speculation.items():
            E.save_draft(s.draft, str(root / f"draft-{name}"))
            job["targets"].append(dict(name=name, dir=zoo.dir(name),
                                       draft=str(root / f"draft-{name}"), spec_prompt=s.prompt))
        return run_workers(ds_tp_worker, job, root)
    return SimpleNamespace(job=job, ranks=built_once(tmp_path_factory, "ds_tp", build))


def ds_tp_worker(job, rank):
    """Per rank: deepseek targets over 2 ranks: all-reduces, slices, decoding, FP8 load."""
    results, calls = {}, [0]
    real_all_reduce = torch.distributed.all_reduce

    def counting_all_reduce(*args, **kwargs):
        calls[0] += 1
        return real_all_reduce(*args, **kwargs)

    for case in job["targets"]:
        target = E.load_target(case["dir"])
        draft = E.load_draft(case["draft"], target)
        torch.distributed.all_reduce, calls[0] = counting_all_reduce, 0
        logits, aux = target(job["prompt"])
        torch.distributed.all_reduce = real_all_reduce
        attn, moe = target.model.layers[0].self_attn, target.model.layers[LAYERS - 1].mlp
        q = attn.q_b_proj if attn.m.q_lora_rank else attn.q_proj
        results[case["name"]] = dict(
            logits=logits, aux=aux, all_reduces=calls[0],
            comm=comm_of_runs(target, draft, job["prompt"], case["spec_prompt"]),
            slices={key: m.weight.clone() for key, m in dict(
                q=q, kv_b=attn.kv_b_proj, o=attn.o_proj, expert_up=moe.experts[1].up_proj,
                expert_down=moe.experts[1].down_proj, shared_gate=moe.shared_experts.gate_proj,
            ).items()},
            greedy=E.greedy_generate(target, case["spec_prompt"], 24),
            speculative=tp_speculative(target, draft, case["spec_prompt"], DS_SHAPES, 24))
    results["fp8_logits"] = E.load_target(job["fp8"])(job["prompt"])[0]
    return results


@pytest.mark.parametrize("name", DS_TARGETS)
def test_deepseek_tensor_parallel_equals_one_process_shards_and_counts_its_collectives(
        zoo, ds_speculation, ds_tp_run, name):
    ids, hf, text = ds_tp_run.job["prompt"], zoo.hf(name), ds_speculation[name].text[:24].tolist()
    logits, aux = zoo.target(name)(ids)
    attn, moe = hf.model.layers[0].self_attn, hf.model.layers[LAYERS - 1].mlp
    width = hf.config.moe_intermediate_size
    full = {"q": ((attn.q_b_proj if hf.config.q_lora_rank else attn.q_proj).weight, 0),
            "kv_b": (attn.kv_b_proj.weight, 0), "o": (attn.o_proj.weight, 1),
            "expert_up": (moe.experts.gate_up_proj[1][width:], 0),   # fused [gate; up] rows
            "expert_down": (moe.experts.down_proj[1], 1),
            "shared_gate": (moe.shared_experts.gate_proj.weight, 0)}
    for r, rank in enumerate(ds_tp_run.ranks):
        assert_close(rank[name]["logits"], logits, "logits")
        assert_close(rank[name]["aux"], aux, "aux")
        assert rank[name]["greedy"].tolist() == text
        assert all(tokens.tolist() == text for tokens, _ in rank[name]["speculative"])
        for key, (weight, dim) in full.items():
            assert torch.equal(rank[name]["slices"][key], weight.detach().chunk(2, dim)[r]), key
        assert rank[name]["all_reduces"] == 2 * LAYERS
        assert_comm_counts(rank[name]["comm"], zoo.target(name).cfg, 8)
    assert torch.equal(ds_tp_run.ranks[0][name]["logits"], ds_tp_run.ranks[1][name]["logits"])


# ========================================================================================
# SPEC 4. the EAGLE-3 drafter: checkpoints in the official layout, exact forward
# ========================================================================================


def test_draft_checkpoint_round_trip_gives_identical_logits_and_trees_without_a_map_too(
        speculation, tmp_path):
    s = speculation["qwen3"]                                      # has d2t/t2d
    E.save_draft(s.draft, str(tmp_path))
    assert E.read_json(tmp_path / "config.json")["architectures"] == ["LlamaForCausalLMEagle3"]
    layer = ["hidden_norm", "input_layernorm", "post_attention_layernorm"] + [
        f"self_attn.{x}_proj" for x in "qkvo"] + [f"mlp.{x}_proj" for x in ("gate", "up", "down")]
    assert set(load_file(tmp_path / "model.safetensors")) == {  # the official keys: no embedding
        "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {
        f"midlayer.{name}.weight" for name in layer}
    loaded = E.load_draft(str(tmp_path), s.target)
    _, aux = s.target(s.prompts["fresh"])
    ids = torch.cat([s.prompts["fresh"], s.reference["fresh"][:1][None]], dim=1)
    h = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded.logits(h), s.draft.logits(h))
    trees = E.draft_tree(loaded, aux, ids, 3, 3, 16), E.draft_tree(s.draft, aux, ids, 3, 3, 16)
    assert all(torch.equal(a, b) for a, b in zip(*trees))
    # The official loader's case: draft_vocab_size == vocab_size and no d2t/t2d stored. It
    # must draft exactly as the same weights with an explicit identity map.
    s = speculation["llama"]               # a full-vocab drafter, sharpened: drafts go deep
    bare, mapped = str(tmp_path / "bare"), str(tmp_path / "mapped")
    E.save_draft(s.draft, bare)
    edit_draft_dir(bare, config=lambda raw: raw.update(draft_vocab_size=VOCAB))
    shutil.copytree(bare, mapped)
    edit_draft_dir(mapped, state=lambda w: w.update(
        d2t=torch.zeros(VOCAB, dtype=torch.long), t2d=torch.ones(VOCAB, dtype=torch.bool)))
    bare, mapped = E.load_draft(bare, s.target), E.load_draft(mapped, s.target)
    assert mapped.cfg.has_vocab_map and not bare.cfg.has_vocab_map
    for kind, prompt in s.prompts.items():
        a, b = (E.speculative_generate(s.target, draft, prompt, 24, tree=E.TreeShape(3, 3, 12))
                for draft in (mapped, bare))
        assert a.tokens.tolist() == b.tokens.tolist() == s.reference[kind][:24].tolist()
        assert a.accept_lengths == b.accept_lengths
        assert all(torch.equal(ra.tree.tokens, rb.tree.tokens)
                   for ra, rb in zip(a.rounds, b.rounds)), kind
        if kind == "memorized":
            assert max(a.accept_lengths) >= 3  # deep paths: the map is really exercised


def official_draft_dir(path, target, draft_vocab_size=20):
    """A drafter dir as released for LLaMA-3.1-8B (.bin, no embedding nor rope_theta) -> state."""
    path.mkdir()
    kept = torch.arange(draft_vocab_size)
    draft = tiny_draft(target, seed=5, kept=kept, std=0.2)
    state = {k: v.clone() for k, v in draft.state_dict().items()
             if not k.startswith("embed_tokens")}
    torch.save(state, path / "pytorch_model.bin")
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=HIDDEN,
                  intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  num_hidden_layers=1, max_position_embeddings=2048, rms_norm_eps=1e-5,
                  hidden_act="silu", initializer_range=0.02, pad_token_id=0,
                  tie_word_embeddings=False, torch_dtype="float16", use_cache=True,
                  vocab_size=VOCAB, draft_vocab_size=draft_vocab_size)
    (path / "config.json").write_text(json.dumps(config))
    return state


def test_official_layout_drafter_loads_with_rope_base_10000(zoo, tmp_path):
    target = zoo.target("llama3-rope")           # rope_theta 500000 + llama3 scaling
    state = official_draft_dir(tmp_path / "draft", target)
    draft = E.load_draft(str(tmp_path / "draft"), target)
    hs = HIDDEN // 4
    expected = 1.0 / 10000 ** (torch.arange(0, hs, 2, dtype=torch.float) / hs)
    assert torch.allclose(draft.cfg.inv_freq.cpu(), expected, rtol=1e-6, atol=0)
    for key, value in state.items():
        assert torch.equal(draft.state_dict()[key], value), key
    assert torch.equal(draft.embed_tokens.weight, zoo.hf("llama3-rope").model.embed_tokens.weight)
    assert draft.cfg.aux_layers == (2, 4, 5)


def test_eagle_aux_layer_ids_are_read_and_written_in_the_drafters_convention(zoo):
    # SpecForge's output-of-layer-k ids (the default reading) are inputs of layer k + 1; vLLM's
    # and llama.cpp's the inputs themselves; SGLang's add 1 only after a 1 (its legacy
    # reading: always); a config without ids reads the default (2, L//2, L-3)
    for ids, expected in (([2, 30, 58], ((3, 31, 59), (2, 30, 58), (2, 30, 58), (3, 31, 59),
                                         (2, 30, 58))),
                          ([1, 29, 57], ((2, 30, 58), (1, 29, 57), (2, 30, 58), (2, 30, 58),
                                         (1, 29, 57)))):
        assert {c: E.aux_inputs(ids, c) for c in E.AUX_CONVENTIONS} == dict(zip(
            ("specforge", "vllm", "sglang", "sglang-legacy", "llama.cpp"), expected))
    target = zoo.target("llama")

    def aux_layers(ids, **convention):
        raw = draft_config(target.cfg, eagle_config=dict(eagle_aux_hidden_state_layer_ids=ids))
        return E.read_draft_config(raw, target.cfg, **convention).aux_layers

    assert aux_layers([1, LAYERS // 2 - 1, LAYERS - 4]) == (2, LAYERS // 2, LAYERS - 3)
    assert aux_layers([0, 3, 6]) == (1, 4, 7)
    assert aux_layers([2, 4, 5]) == (3, 5, 6)
    assert aux_layers([2, 4, 5], aux_convention="vllm") == (2, 4, 5)
    assert E.read_draft_config(draft_config(target.cfg), target.cfg,
                               aux_convention="vllm").aux_layers == (2, 4, 5)   # the default


def saved_eagle_config(draft, path, engine):
    E.save_draft(draft, str(path), engine=engine)
    raw = E.read_json(path / "config.json")
    # engines build num_hidden_layers layers (transformers' default: 32): one is written
    assert raw["num_hidden_layers"] == 1
    return raw["eagle_config"]


@pytest.mark.parametrize("engine", E.AUX_CONVENTIONS)
def test_a_drafter_saved_for_an_engine_is_fed_the_layers_it_was_trained_on(zoo, tmp_path, engine):
    # trained on the inputs of layers 3, 5, 6 (not the default 2, 4, 5): the ids written for
    # each engine, read the way that engine reads them (and by our loader, which follows the
    # config's declared convention), name those layers again
    target = zoo.target("llama")
    draft = tiny_draft(target, 1, eagle_config=dict(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert draft.cfg.aux_layers == (3, 5, 6) and not draft.cfg.aux_default
    eagle = saved_eagle_config(draft, tmp_path, engine)
    ids = eagle["eagle_aux_hidden_state_layer_ids"]
    # by hand: specforge and sglang-legacy add 1; vllm and llama.cpp add 0; sglang adds 1 only
    # after a 1; llama.cpp reads only top-level ids, so they are written there too
    assert ids == {"vllm": [3, 5, 6], "sglang": [3, 5, 6], "llama.cpp": [3, 5, 6]}.get(
        engine, [2, 4, 5])
    top = E.read_json(tmp_path / "config.json").get("eagle_aux_hidden_state_layer_ids")
    assert top == (ids if engine == "llama.cpp" else None)
    assert eagle["eagle_aux_hidden_state_layer_ids_convention"] == engine
    assert E.aux_inputs(ids, engine) == (3, 5, 6)
    assert E.load_draft(str(tmp_path), target).cfg.aux_layers == (3, 5, 6)
    assert E.load_draft(str(tmp_path), target, aux_convention=engine).cfg.aux_layers == (3, 5, 6)


def test_default_aux_layers_are_saved_without_ids_and_inexpressible_ones_refused(zoo, tmp_path):
    target = zoo.target("llama")
    draft = tiny_draft(target, seed=1)                        # trained on (2, L//2, L-3)
    assert draft.cfg.aux_default
    for engine in E.AUX_CONVENTIONS:
        eagle = saved_eagle_config(draft, tmp_path, engine)
        assert "eagle_aux_hidden_state_layer_ids" not in eagle, engine
        assert "eagle_aux_hidden_state_layer_ids" not in E.read_json(tmp_path / "config.json")
        for convention in E.AUX_CONVENTIONS:                  # every engine reads the default
            assert E.load_draft(str(tmp_path), target, aux_convention=convention
                                ).cfg.aux_layers == (2, LAYERS // 2, LAYERS - 3)
    # a config saved before the convention was named is read as SpecForge's (how it was saved)
    old = tiny_draft(target, seed=1, eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 3, 6]))
    assert old.cfg.aux_layers == (1, 4, 7)
    # SGLang reads [0, 3, 6] as (0, 3, 6) and [1, 4, 7] as (2, 5, 8): (1, 4, 7) has no ids there
    with pytest.raises(E.Eagle3Error, match=r"aux layers \[1, 4, 7\] cannot be written in "
                                         r"sglang's convention"):
        E.save_draft(old, str(tmp_path / "sglang"), engine="sglang")
    assert not (tmp_path / "sglang").exists()
    edit_draft_dir(str(tmp_path), config=lambda raw: raw.update(num_hidden_layers=2))
    with pytest.raises(E.Eagle3Error, match=r"draft num_hidden_layers=2: an EAGLE-3 drafter "
                                            r"has one decoder layer"):
        E.load_draft(str(tmp_path), target)


KEPT_20 = [0, 1, 2, 3, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22]
BAD_DRAFTS = {  # name -> (draft vocab, an edit of the saved weights, what the error says)
    "d2t-outside-target-vocab": (KEPT_20, lambda s: s["d2t"].__setitem__(-1, VOCAB),  # 19 -> 43
                                 r"d2t maps draft id 19 to target id 43, outside the target "
                                 r"vocab \[0, 24\)"),
    "t2d-disagrees-with-d2t": (KEPT_20, lambda s: s["t2d"].__setitem__(  # same count, wrong ids
        [0, 4], torch.tensor([False, True])), r"t2d disagrees with d2t"),
    "missing-key": (KEPT_20, lambda s: s.pop("midlayer.mlp.up_proj.weight"),
                    r"missing keys \['midlayer\.mlp\.up_proj\.weight'\]"),
    "wrong-fc-width": (KEPT_20, lambda s: s.update(
        {"fc.weight": s["fc.weight"][:, :2 * HIDDEN].contiguous()}),
        r"'fc\.weight'.* has shape \(64, 128\).*expects \(64, 192\)"),
    # a full-vocab map is checked too: the identity it may stand for does not excuse it
    "full-vocab-d2t-maps-two-ids-to-one": (list(range(VOCAB)), lambda s: s["d2t"].__setitem__(
        3, 1), r"d2t maps two draft ids to the same target id"),      # 3 -> 4, twice
}


@pytest.mark.parametrize("problem", list(BAD_DRAFTS))
def test_bad_draft_checkpoint_is_refused_naming_the_problem(zoo, tmp_path, problem):
    kept, edit, message = BAD_DRAFTS[problem]
    target = zoo.target("llama")
    E.save_draft(tiny_draft(target, seed=2, kept=torch.tensor(kept)), str(tmp_path))
    edit_draft_dir(tmp_path, state=edit)
    with pytest.raises(E.Eagle3Error, match=message):
        E.load_draft(str(tmp_path), target)


def reference_drafter(draft, aux, input_ids, steps, H, Hkv, hs, eps=1e-6, theta=10000.0):
    """The drafter (SPEC 4, 6) in plain ops; TTT step k sees [causal | diag ...] -> [(h, log q)]."""
    w = {k: v.detach().float() for k, v in draft.state_dict().items()}
    B, T = input_ids.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, hs, 2, dtype=torch.float) / hs)

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x (B, T, heads, hs)
        angle = pos.float()[:, None] * inv_freq[None, :]
        angle = torch.cat([angle, angle], -1)[None, :, None, :]
        return x * angle.cos() + torch.cat([-x[..., hs // 2:], x[..., :hs // 2]], -1) * angle.sin()

    h, keys, values, out = aux.float() @ w["fc.weight"].T, [], [], []
    for k in range(steps):
        tokens = shift_left(input_ids, 1 + k)                  # position t holds x[t+1+k]
        x = torch.cat([rms(w["embed_tokens.weight"][tokens], w["midlayer.input_layernorm.weight"]),
                       rms(h, w["midlayer.hidden_norm.weight"])], -1)
        pos = torch.arange(T) + k
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(B, T, H, hs), pos)
        keys.append(rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(B, T, Hkv, hs), pos))
        values.append((x @ w["midlayer.self_attn.v_proj.weight"].T).view(B, T, Hkv, hs))
        all_k, all_v = torch.cat(keys, 1), torch.cat(values, 1)        # (B, (k+1)T, Hkv, hs)
        allowed = torch.cat([torch.ones(T, T).tril().bool()] + [torch.eye(T).bool()] * k, 1)
        y = torch.zeros(B, T, H, hs)
        for head in range(H):
            g = head // (H // Hkv)
            scores = torch.einsum("btd,bsd->bts", q[:, :, head], all_k[:, :, g]) / math.sqrt(hs)
            scores = scores.masked_fill(~allowed, float("-inf"))
            y[:, :, head] = torch.softmax(scores, -1) @ all_v[:, :, g]
        h = h + y.reshape(B, T, H * hs) @ w["midlayer.self_attn.o_proj.weight"].T
        n = rms(h, w["midlayer.post_attention_layernorm.weight"])
        gate, up = n @ w["midlayer.mlp.gate_proj.weight"].T, n @ w["midlayer.mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        out.append((h, torch.log_softmax(rms(h, w["norm.weight"]) @ w["lm_head.weight"].T, -1)))
    return out


def test_drafter_with_its_own_head_dim_loads_and_runs_as_written_out(zoo, tmp_path):
    # hidden 64 over 4 heads would give 16; the config says 24 (SpecForge writes head_dim)
    target = zoo.target("llama")
    E.save_draft(tiny_draft(target, seed=9, std=0.2, head_dim=24), str(tmp_path))
    draft = E.load_draft(str(tmp_path), target)
    assert draft.midlayer.self_attn.q_proj.weight.shape == (4 * 24, 2 * HIDDEN)
    assert draft.midlayer.self_attn.k_proj.weight.shape == (2 * 24, 2 * HIDDEN)
    assert draft.midlayer.self_attn.o_proj.weight.shape == (HIDDEN, 4 * 24)
    prompt = random_prompt(31, length=9)
    _, aux = target(prompt)
    [(h_ref, log_q_ref)] = reference_drafter(draft, aux, prompt, 1, H=4, Hkv=2, hs=24)
    T, tokens = 9, shift_left(prompt, 1)          # pairs (feature of token p, token p+1)
    h = draft(draft.fc(aux), tokens, torch.arange(T), torch.ones(T, T).tril().bool())
    assert_close(h, h_ref, "pre-norm output")
    assert_close(torch.log_softmax(draft.logits(h), -1), log_q_ref, "log-probabilities")
    # a head width of 1 (hidden_size / heads: transformers' RoPE check misses it) is refused
    with pytest.raises(E.Eagle3Error, match=r"drafter config gives head_dim=1: RoPE rotates "):
        E.read_draft_config(draft_config(target.cfg, num_attention_heads=HIDDEN), target.cfg)
    # a variant's flags (EAGLE-3.1's norms, an engine's extras) change what it computes
    for key, flag in ([(k, {k: True}) for k in E.VARIANT_DRAFT_FLAGS] +
                      [("logit_scale", dict(logit_scale=0.5)), ("use_aux_hidden_state", dict(
                          eagle_config=dict(use_aux_hidden_state=False)))]):
        with pytest.raises(E.Eagle3Error, match=f"sets {{'{key}'"):
            E.read_draft_config(draft_config(target.cfg, **flag), target.cfg)


# ========================================================================================
# SPEC 5. tree, verify, acceptance
# ========================================================================================


# ----------------------------------------------------------------------------------------
# the draft tree: a hand-worked example with a scripted drafter, and invariants


class ScriptedDrafter:
    """A drafter over the whole target vocab (no map), without a cache."""

    def __init__(self, V, aux_layers=(2, 4, 5)):
        self.cfg = SimpleNamespace(aux_layers=aux_layers, vocab_size=V, draft_vocab_size=V)

    def to_target_ids(self, draft_ids):
        return draft_ids

    continuations = E.Draft.continuations  # the tree's ranking step, on this drafter's logits

    def new_cache(self, length):
        return None


class MarkovDrafter(ScriptedDrafter):
    """Scripted: log-probs of the next token depend on the last token only; records its calls."""

    def __init__(self, probs):
        self.table = torch.tensor(probs).log()                       # (V, V) log-probs
        super().__init__(self.table.shape[0])
        self.calls = []

    def fc(self, aux):
        return aux.new_zeros(*aux.shape[:-1], self.cfg.vocab_size)

    def __call__(self, h, tokens, positions, mask, cache=None, start=0):
        self.calls.append(dict(tokens=tokens.tolist(), positions=positions.tolist(),
                               mask=mask.int().tolist(), start=start))
        return F.one_hot(tokens, self.cfg.vocab_size).to(h.dtype)

    def logits(self, h):
        return h @ self.table


def markov_rows(top, V=6):
    """Probability rows: the listed tokens get their probabilities, the rest share what is left."""
    rows = []
    for last in range(V):
        rest = [t for t in range(V) if t not in top[last]]
        left = (1 - sum(top[last].values())) / len(rest)
        rows.append([top[last].get(t, left) for t in range(V)])
    return rows


# P(next | last) for the hand-worked tree; the two most likely next tokens of each row:
HAND_TABLE = markov_rows({0: {1: .6, 2: .25}, 1: {3: .7, 4: .2}, 2: {5: .5, 3: .3},
                          3: {2: .9, 1: .05}, 4: {0: .4, 1: .3}, 5: {0: .55, 4: .4}})
HAND_INPUT = torch.tensor([[5, 4, 3, 0]])   # three featured tokens, then the root 0


def test_draft_tree_and_its_draft_passes_match_the_hand_worked_example():
    # top_k=2, depth=2, total_tokens=5; scores are cumulative probabilities (log-probs summed):
    #   level 1, children of root 0:  pool 0 = token 1 (.6)   pool 1 = token 2 (.25)
    #   expand pool 0 (token 1, .6):  pool 2 = token 3 (.42)  pool 3 = token 4 (.12)
    #   expand pool 1 (token 2, .25): pool 4 = token 5 (.125) pool 5 = token 3 (.075)
    #   rerank: best two of {.42, .12, .125, .075} = pool 2 (.42), pool 4 (.125)
    #   expand pool 2 (token 3, .42): pool 6 = token 2 (.378) pool 7 = token 1 (.021)
    #   expand pool 4 (token 5, .125):pool 8 = token 0 (.06875) pool 9 = token 4 (.05)
    #   best 4 of the 10: .6 (0), .42 (2), .378 (6), .25 (1) -> by flat index [0, 1, 2, 6]
    #   nodes 1..4 = pool 0, 1, 2, 6; parents: root, root, pool 0 = node 1, pool 2 = node 3
    # Drafting: the prefix pass feeds pairs (feature of token p, token p+1) at positions 0..2;
    # level 1 (tokens 1, 2) sits at position 3 in draft slots 3-4, level 2 (tokens 3, 5:
    # children of slots 3 and 4) at position 4 in slots 5-6; each row sees the 3 prefix
    # slots, its ancestors and itself.
    drafter = MarkovDrafter(HAND_TABLE)
    tree = E.draft_tree(drafter, torch.zeros(1, 3, 3 * HIDDEN), HAND_INPUT, 2, 2, 5)
    assert tree.tokens.tolist() == [0, 1, 2, 3, 2]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3]
    assert tree.positions.tolist() == [0, 1, 1, 2, 3]
    assert tree.mask.int().tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 0, 1, 0, 0],
                                        [1, 1, 0, 1, 0],
                                        [1, 1, 0, 1, 1]]
    assert tree.retrieve_indices.tolist() == [[0, 2, -1, -1], [0, 1, 3, 4]]  # leaves 2 and 4
    assert drafter.calls == [
        dict(tokens=[[4, 3, 0]], positions=[0, 1, 2], start=0,
             mask=[[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        dict(tokens=[[1, 2]], positions=[3, 3], start=3,
             mask=[[1, 1, 1, 1, 0], [1, 1, 1, 0, 1]]),
        dict(tokens=[[3, 5]], positions=[4, 4], start=5,
             mask=[[1, 1, 1, 1, 0, 1, 0], [1, 1, 1, 0, 1, 0, 1]]),
    ]


def tree_paths(tree, where=""):
    """Each node's root-first path, once the tree's fields are checked against its parents
    (each before its child): positions, mask, retrieve_indices (a row per leaf, -1 padded)."""
    parents = tree.parents.tolist()
    assert parents[0] == -1 and all(0 <= parents[i] < i for i in range(1, len(parents))), where
    paths = [path_to(parents, i) for i in range(len(parents))]
    assert tree.positions.tolist() == [len(p) - 1 for p in paths], where
    assert tree.mask.tolist() == [[j in p for j in range(len(paths))] for p in paths], where
    width = max(len(p) for p in paths)
    assert tree.retrieve_indices.tolist() == [p + [-1] * (width - len(p)) for i, p in
                                              enumerate(paths) if i not in parents], where
    return paths


def test_draft_tree_invariants_hold_for_random_drafters(zoo):
    target = zoo.target("llama")
    kept = torch.tensor([0, 1, 2, 4, 5, 7, 8, 9, 11, 12, 14, 15, 17, 19, 20, 23])  # 16 of 24
    drafters = [tiny_draft(target, seed=s, kept=kept if s % 2 else None, std=0.3)
                for s in range(4)]
    g = torch.Generator().manual_seed(11)
    for case in range(40):
        draft = drafters[case % 4]
        top_k = int(torch.randint(1, 5, (), generator=g))
        depth = int(torch.randint(1, 5, (), generator=g))
        total = int(torch.randint(2, top_k + depth * top_k ** 2 + 2, (), generator=g))
        T = int(torch.randint(1, 10, (), generator=g))
        aux = torch.randn(1, T, 3 * HIDDEN, generator=g) * 3
        ids = torch.randint(0, VOCAB, (1, T + 1), generator=g)
        tree = E.draft_tree(draft, aux, ids, top_k, depth, total)
        where = f"case {case}: top_k={top_k} depth={depth} total_tokens={total}"
        paths, parents = tree_paths(tree, where), tree.parents.tolist()
        assert len(paths) == total and tree.tokens[0] == ids[0, -1], where
        assert max(len(p) for p in paths) <= depth + 2, where
        for node in range(total):
            children = [int(tree.tokens[c]) for c in range(total) if parents[c] == node]
            assert len(children) == len(set(children)), where            # distinct siblings
            assert len(children) <= top_k, where
        if draft.cfg.has_vocab_map:                                 # drafted ids mapped by d2t
            assert set(tree.tokens[1:].tolist()) <= set(kept.tolist()), where


# ========================================================================================
# SPEC 5 (continued): greedy acceptance: speculative output equals greedy decoding
# ========================================================================================

SPEC_TARGETS = {  # target -> draft vocab (None: the target's) and whether it is sharpened
    "llama": dict(kept=None, sharpen=True),
    "qwen3": dict(kept=torch.tensor(KEPT_20), sharpen=True),
    "qwen2": dict(kept=None, sharpen=False),
}
REFERENCE_TOKENS = 48  # greedy text beyond every output, for the deepest possible tree paths


@pytest.fixture(scope="module")
def speculation(zoo):
    """Per target: a drafter (sharpened on the 'memorized' prompt or not), prompts, greedy text."""
    setups = {}
    for i, (name, spec) in enumerate(SPEC_TARGETS.items()):
        hf, target = zoo.hf(name), zoo.target(name)
        prompts = dict(memorized=random_prompt(100 + i, length=8), fresh=random_prompt(200 + i, 8))
        reference = {kind: hf_greedy(hf, p, REFERENCE_TOKENS) for kind, p in prompts.items()}
        if spec["sharpen"]:
            draft = tiny_draft(target, seed=i, kept=spec["kept"])
            others = [random_prompt(300 + i * 10 + j, 8) for j in range(2)]
            texts = [torch.cat([p[0], hf_greedy(hf, p, REFERENCE_TOKENS)]) for p in others]
            texts.append(torch.cat([prompts["memorized"][0], reference["memorized"]]))
            sharpen(draft, target, torch.stack(texts))
        else:
            draft = tiny_draft(target, seed=i, std=0.3)
            with torch.no_grad():
                draft.lm_head.weight.mul_(3)
        setups[name] = SimpleNamespace(hf=hf, target=target, draft=draft, kept=spec["kept"],
                                       prompts=prompts, reference=reference)
    return setups


COMBOS = [  # (target, prompt, top_k, depth, total_tokens, max_new_tokens)
    ("llama", "memorized", 1, 1, 2, 32),     # a chain of one draft
    ("llama", "memorized", 1, 4, 6, 32),     # a chain at the pool maximum 1 + 4*1 + 1
    ("llama", "fresh", 1, 3, 5, 32),
    ("llama", "memorized", 2, 1, 7, 32),     # depth 1, pool maximum 2 + 1*4 + 1
    ("llama", "fresh", 3, 1, 5, 32),
    ("llama", "memorized", 2, 3, 15, 32),    # pool maximum 2 + 3*4 + 1
    ("llama", "memorized", 3, 2, 10, 7),     # the budget ends inside a round
    ("llama", "fresh", 4, 3, 20, 32),
    ("llama", "memorized", 4, 5, 40, 32),
    ("llama", "fresh", 2, 2, 4, 1),          # only the prefill's token
    ("llama", "memorized", 10, 7, 60, 32),   # the official default tree
    ("qwen3", "memorized", 1, 2, 4, 32),     # chain at the pool maximum
    ("qwen3", "fresh", 2, 1, 3, 32),
    ("qwen3", "memorized", 2, 2, 11, 32),    # pool maximum 2 + 2*4 + 1
    ("qwen3", "memorized", 3, 3, 16, 32),
    ("qwen3", "fresh", 3, 4, 40, 32),        # pool maximum 3 + 4*9 + 1
    ("qwen3", "memorized", 5, 2, 25, 32),
    ("qwen3", "fresh", 4, 1, 21, 32),        # depth 1, pool maximum 4 + 16 + 1
    ("qwen2", "fresh", 2, 3, 8, 32),         # an unsharpened random drafter
    ("qwen2", "memorized", 4, 4, 60, 32),
    ("qwen2", "fresh", 1, 5, 7, 32),         # chain at the pool maximum
]


@pytest.mark.parametrize("name, kind, top_k, depth, total, max_new", COMBOS)
def test_greedy_speculative_equals_greedy_and_accepts_the_longest_matching_path(
        speculation, name, kind, top_k, depth, total, max_new):
    # Against transformers' greedy text; each round's accept length against a brute force
    # over every node of its tree: the deepest whose root-to-node tokens are the greedy text.
    s, text = speculation[name], speculation[name].reference[kind].tolist()
    result = E.speculative_generate(s.target, s.draft, s.prompts[kind], max_new,
                                    tree=E.TreeShape(top_k, depth, total))
    assert result.tokens.tolist() == text[:max_new]
    assert E.greedy_generate(s.target, s.prompts[kind], max_new).tolist() == text[:max_new]
    at = 0                                       # output index of this round's root
    assert len(result.rounds) == len(result.accept_lengths)
    for r, (round_, accept_length) in enumerate(zip(result.rounds, result.accept_lengths)):
        tokens, parents = round_.tree.tokens.tolist(), round_.tree.parents.tolist()
        assert tokens[0] == text[at], f"round {r}"
        matching = [len(p) - 1 for p in (path_to(parents, i) for i in range(len(tokens)))
                    if [tokens[j] for j in p] == text[at:at + len(p)]]
        assert accept_length == max(matching) + 1, f"round {r}"
        at += accept_length
    if kind == "memorized" and SPEC_TARGETS[name]["sharpen"] and depth >= 2:
        assert max(result.accept_lengths) >= 3, "no round accepted two drafts"


class OracleDrafter(ScriptedDrafter):
    """Scripted: draft position p predicts token p+2 of `sequence`; records its fc inputs."""

    def __init__(self, sequence, aux_layers=(2, 4, 5)):
        super().__init__(VOCAB, aux_layers)
        self.sequence, self.fed = sequence, []

    def fc(self, aux):
        self.fed.append(aux.clone())
        return aux[..., :1] * 0

    def __call__(self, h, tokens, positions, mask, cache=None, start=0):
        B, T = tokens.shape
        return positions.to(h.dtype).reshape(1, T, 1).expand(B, T, 1)

    def logits(self, h):
        return 50.0 * F.one_hot(self.sequence[h[..., 0].long() + 2], VOCAB).to(h.dtype)


@pytest.mark.parametrize("top_k, depth, total", [(1, 3, 5), (2, 2, 7), (3, 4, 20), (4, 1, 6)])
def test_drafter_predicting_the_greedy_text_accepts_depth_plus_two_per_round(zoo, top_k, depth,
                                                                             total):
    prompt, max_new = random_prompt(12), 30
    text = hf_greedy(zoo.hf("llama"), prompt, max_new + depth + 3)
    oracle = OracleDrafter(torch.cat([prompt[0], text]))
    result = E.speculative_generate(zoo.target("llama"), oracle, prompt, max_new,
                                    tree=E.TreeShape(top_k, depth, total))
    assert result.tokens.tolist() == text[:max_new].tolist()
    # the prefill gives token 1; each round then emits depth+1 drafts and a bonus token
    assert len(result.accept_lengths) == math.ceil((max_new - 1) / (depth + 2))
    assert result.accept_lengths[:-1] == [depth + 2] * (len(result.accept_lengths) - 1)


def test_drafter_is_fed_target_features_of_its_aux_layers(zoo):
    # eagle_aux_hidden_state_layer_ids [0, 3, 6] (output of layer k) = inputs of layers 1, 4, 7.
    # The prefill features, then each round's root + accepted nodes: consecutive positions.
    target, prompt, max_new = zoo.target("llama"), random_prompt(13), 20
    raw = draft_config(target.cfg, eagle_config=dict(eagle_aux_hidden_state_layer_ids=[0, 3, 6]))
    cfg = E.read_draft_config(raw, target.cfg)
    text = hf_greedy(zoo.hf("llama"), prompt, max_new + 6)
    oracle = OracleDrafter(torch.cat([prompt[0], text]), aux_layers=cfg.aux_layers)
    result = E.speculative_generate(target, oracle, prompt, max_new, tree=E.TreeShape(2, 3, 8))
    fed = torch.cat(oracle.fed, dim=1)[0]                        # (positions, 3*D)
    assert len(oracle.fed) == len(result.rounds)                 # prefill + all but the last round
    assert fed.shape[0] == prompt.shape[1] + sum(result.accept_lengths[:-1])
    _, hidden_states = hf_forward(zoo.hf("llama"), torch.cat([prompt[0], text])[None])
    assert_close(fed, hf_aux(hidden_states, (1, 4, 7))[:fed.shape[0]])


def test_speculative_generate_alone_and_batched_stops_at_first_eos(speculation):
    s = speculation["llama"]
    text = s.reference["memorized"].tolist()
    first = next(i for i in range(8, 32) if text[i] not in text[:i])   # a token new at i >= 8
    expected = text[:first + 1]                                       # up to and with the EOS
    result = E.speculative_generate(s.target, s.draft, s.prompts["memorized"], 32,
                                    tree=E.TreeShape(3, 3, 12), eos_token_id=text[first])
    assert result.tokens.tolist() == expected
    assert E.greedy_generate(s.target, s.prompts["memorized"], 32, text[first]).tolist() == expected
    # in a batch, a row that finishes early stops emitting while the others go on
    eos, prompts = text[5], [s.prompts["memorized"]] + BATCH_PROMPTS[1:3]   # row 0's 6th token
    results = E.speculative_generate_batch(s.target, s.draft, prompts, 20,
                                           tree=E.TreeShape(2, 2, 6), eos_token_id=eos)
    for ids, r in zip(prompts, results):
        assert r.tokens.tolist() == E.greedy_generate(s.target, ids, 20, eos).tolist()
    assert results[0].tokens.tolist()[-1] == eos and len(results[0].tokens) <= 6


DS_SHAPES = [(1, 3, 5), (2, 2, 7), (3, 3, 12), (4, 2, 16)]


@pytest.fixture(scope="module")
def ds_speculation(zoo):
    """Per target: a drafter sharpened on transformers' greedy text, prompt, 48 tokens."""
    setups = {}
    for i, name in enumerate(DS_TARGETS):
        hf, target = zoo.hf(name), zoo.target(name)
        for seed in range(500 + 100 * i, 600 + 100 * i):  # the first prompt without near-ties
            prompt = random_prompt(seed, length=8)
            text = hf_greedy(hf, prompt, REFERENCE_TOKENS)
            sequence = torch.cat([prompt[0], text])[None]
            if routing_gap(hf, sequence) > MIN_ROUTING_GAP:
                break
        assert_routing_is_robust(hf, sequence)
        draft = sharpen(tiny_draft(target, seed=i), target, sequence)
        setups[name] = SimpleNamespace(hf=hf, target=target, draft=draft, prompt=prompt,
                                       text=text)
    return setups


@pytest.mark.parametrize("shape", DS_SHAPES, ids=lambda s: "k{}-d{}-n{}".format(*s))
@pytest.mark.parametrize("name", DS_TARGETS)
def test_deepseek_greedy_speculative_equals_transformers_greedy(ds_speculation, name, shape):
    s = ds_speculation[name]
    result = E.speculative_generate(s.target, s.draft, s.prompt, 32, tree=E.TreeShape(*shape))
    assert result.tokens.tolist() == s.text[:32].tolist()
    assert max(result.accept_lengths) >= 3     # rounds that accept >= 2 drafts


# ========================================================================================
# SPEC 5 (continued): sampling acceptance: the exact law of a vocab-6 target, and speculation replayed round by round
# ========================================================================================

V = 6                                  # target vocab: 6**3 = 216 three-token outcomes
PROMPT = torch.tensor([[1, 4, 2]])
N_TOKENS = 3                           # generated tokens whose joint law is enumerated
TRIALS = 8_000                         # Monte Carlo runs per chi-square test (broken: p < 1e-20)
ALPHA = 1e-3                           # chi-square significance level
MIN_EXPECTED = 5                       # cells expecting fewer are merged (chi-square rule)
REPLAY_SEEDS = 30                      # full speculative_generate calls per replay test
REPLAY_TOKENS = 6                      # tokens per replayed call (several rounds)
SLOTS = 64                             # cache room beyond the prefix: any tree here fits
T1 = E.Sampling(temperature=1.0)
T07_P09 = E.Sampling(temperature=0.7, top_k=0, top_p=0.9)
SAMPLINGS = {"T1": T1, "T0.7-p0.9": T07_P09}


class Case(NamedTuple):
    scheme: str
    shape: E.TreeShape
    draft: str                         # key of vocab6_drafts
    preset: str = "official"           # whose tree builder (score space, draft positions)
    engine: bool = False               # replays draw as the preset's loop does, not coins()


CASES = {
    "tree-2-2-5": Case("tree", E.TreeShape(2, 2, 5), "full"),
    "tree-3-1-4-vd4": Case("tree", E.TreeShape(3, 1, 4), "vd4"),  # 4-token draft vocab
    "tree-1-3-5": Case("tree", E.TreeShape(1, 3, 5), "full"),
    "chain-2": Case("chain", E.TreeShape(1, 1, 2), "full"),         # 2 sampled drafts/round
}


def coins(seed):
    """The documented stream (SPEC §5): float64 torch.rand, one at a time, Generator(seed)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        yield float(torch.rand((), generator=g, dtype=torch.float64))


@pytest.fixture(scope="module")
def vocab6_checkpoint(tmp_path_factory):
    """(dir, hf): N(0, 0.5) weights (far from uniform), 7 layers, 2 kv heads (runs at W = 2)."""
    hf = tiny_model(seed=0, std=0.5, gains=False, vocab_size=V, hidden_size=16,
                    intermediate_size=32, num_hidden_layers=7, num_attention_heads=2,
                    max_position_embeddings=128)
    path = str(tmp_path_factory.mktemp("vocab6_target"))
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def vocab6_target(vocab6_checkpoint):
    return E.load_target(vocab6_checkpoint[0], dtype=torch.float32, device="cpu")


def vocab6_new_draft(target, seed, kept=None):
    """A random drafter (N(0, 0.5) weights), frozen."""
    draft = tiny_draft(target, seed, kept, std=0.5, num_attention_heads=2, num_key_value_heads=1)
    return draft.eval().requires_grad_(False)


@pytest.fixture(scope="module")
def vocab6_drafts(vocab6_target):
    return {"full": vocab6_new_draft(vocab6_target, seed=1),
            "vd4": vocab6_new_draft(vocab6_target, seed=2, kept=[0, 2, 3, 5])}


class ExactLaw(NamedTuple):
    p1: np.ndarray      # (V,) p(a | prompt)
    p2: np.ndarray      # (V, V) [a, b] = p(b | prompt a)
    p3: np.ndarray      # (V, V, V) [a, b, c] = p(c | prompt a b)

    @property
    def joint(self):    # (V, V, V) law of the first 3 sampled tokens
        return self.p1[:, None, None] * self.p2[:, :, None] * self.p3


@pytest.fixture(scope="module")
def vocab6_exact_law(vocab6_checkpoint):
    """sampling -> ExactLaw after PROMPT, from transformers' 36 continuations' logits."""
    hf, laws = vocab6_checkpoint[1], {}
    pairs = torch.tensor(list(itertools.product(range(V), repeat=2)))       # (36, 2)
    ids = torch.cat([PROMPT.expand(len(pairs), -1), pairs], 1)              # (36, T+2)
    with torch.no_grad():
        logits = hf(ids).logits                                             # (36, T+2, V)
    T = PROMPT.shape[1]

    def law(sampling):
        if sampling not in laws:
            laws[sampling] = ExactLaw(
                hf_warped_probs(logits[:1, T - 1], sampling)[0].numpy(),
                hf_warped_probs(logits[::V, T], sampling).numpy(),         # rows (a, 0)
                hf_warped_probs(logits[:, T + 1], sampling).view(V, V, V).numpy())
        return laws[sampling]
    return law


def chi_square_p(samples, law):
    """p-value against the exact law (small cells pooled); a zero-probability outcome fails."""
    counts = np.zeros(law.size)
    np.add.at(counts, np.ravel_multi_index(np.array(samples).T, law.shape), 1)
    probs = law.ravel()
    assert counts[probs == 0].sum() == 0, \
        f"{int(counts[probs == 0].sum())} samples of zero-probability outcomes"
    expected = probs * len(samples)
    order = np.argsort(expected)
    pooled = max(int((expected < MIN_EXPECTED).sum()),
                 int(np.searchsorted(np.cumsum(expected[order]), MIN_EXPECTED)) + 1)
    small, rest = order[:pooled], order[pooled:]
    observed = np.append(counts[rest], counts[small].sum())
    return chisquare(observed, np.append(expected[rest], expected[small].sum())).pvalue


@torch.no_grad()
def round_start(target, draft, ctx):
    """A round's start after emitting ctx (caches, h_last, root), built by one prefill."""
    ids = torch.cat([PROMPT, torch.tensor([ctx[:-1]], dtype=torch.long)], 1)   # (1, n)
    n = ids.shape[1]
    target_cache, draft_cache = target.new_cache(n + SLOTS), draft.new_cache(n + SLOTS)
    _, aux = target(ids, cache=target_cache, aux_layers=draft.cfg.aux_layers)
    next_tokens = torch.cat([ids[0, 1:], torch.tensor(ctx[-1:])])[None]    # (1, n)
    h_last = E.draft_prefix(draft, draft_cache, 0, aux, next_tokens)
    return target_cache, draft_cache, n, h_last, torch.tensor(ctx[-1])


def tree_rounds(target, draft, shape, preset="official"):
    """Lazy ctx -> (tree, verify logits (N, V)) from the real grow_tree, verify_tree."""
    @functools.cache
    @torch.no_grad()
    def round_after(ctx):
        target_cache, draft_cache, n, h_last, root = round_start(target, draft, ctx)
        tree = grow(draft, draft_cache, n, h_last, root, shape, preset)
        return tree, verify(target, target_cache, n, tree, draft.cfg.aux_layers)[0]
    return round_after


def uniform_choosing(q, token):
    """A uniform that inverse-CDF sampling of q maps to `token`: the middle of its interval."""
    cdf = np.cumsum(q.numpy()) / float(q.sum())
    return ((cdf[token - 1] if token else 0.0) + cdf[token]) / 2


class ChainRounds:
    """Lazy chain tables: q rows of draft_chain steered to each prefix; verify_tree logits."""

    def __init__(self, target, draft, sampling, length):
        self.target, self.draft, self.sampling, self.length = target, draft, sampling, length
        self.q_rows = {}

    @functools.cache
    def start(self, ctx):
        return round_start(self.target, self.draft, ctx)

    @torch.no_grad()
    def q(self, ctx, drafted):
        """q of the next draft after the drafted prefix (tuple of target ids)."""
        if (ctx, drafted) not in self.q_rows:
            steer = [uniform_choosing(self.q(ctx, drafted[:i]), d) for i, d in enumerate(drafted)]
            steer += [0.5] * (self.length - len(drafted))
            _, draft_cache, n, h_last, root = self.start(ctx)
            chain, q, _ = E.draft_chain(self.draft, draft_cache, n, h_last, root, self.length,
                                        iter(steer), self.sampling, E.LOCAL)
            tokens = tuple(chain.tokens[1:].tolist())
            assert tokens[:len(drafted)] == drafted, "steering uniforms missed the prefix"
            for i in range(self.length):
                self.q_rows.setdefault((ctx, tokens[:i]), q[i])
        return self.q_rows[(ctx, drafted)]

    @functools.cache
    @torch.no_grad()
    def logits(self, ctx, drafts):
        target_cache, _, n, _, root = self.start(ctx)
        chain = E.tree_from_parents(torch.tensor((int(root),) + drafts),
                                    torch.arange(-1, len(drafts)))
        return verify(self.target, target_cache, n, chain, self.draft.cfg.aux_layers)[0]


def replay_tree(prefill_logits, rounds, sampling, uniforms, accept, n_tokens):
    """First n_tokens of the tree scheme: the first token's uniform, then each round's accept."""
    out = [E.next_token(prefill_logits, sampling, uniforms, E.LOCAL)[0]]
    while len(out) < n_tokens:
        tree, logits = rounds(tuple(out))
        acc = accept(logits, tree, uniforms, sampling)
        out += tree.tokens[acc.path[1:]].tolist() + [acc.bonus]
    return tuple(out[:n_tokens])


def replay_chain(prefill_logits, chains, sampling, uniforms, accept, n_tokens):
    """Chain rounds replayed: a uniform per draft (inverse CDF of q), then accept's."""
    out = [E.next_token(prefill_logits, sampling, uniforms, E.LOCAL)[0]]
    while len(out) < n_tokens:
        ctx, drafts = tuple(out), ()
        for _ in range(chains.length):
            drafts += (E.sample_inverse_cdf(chains.q(ctx, drafts), next(uniforms)),)
        q = torch.stack([chains.q(ctx, drafts[:i]) for i in range(chains.length)])
        acc = accept(chains.logits(ctx, drafts), torch.tensor(drafts), q, uniforms, sampling)
        out += list(drafts[:acc.accepted]) + [acc.bonus]
    return tuple(out[:n_tokens])


@pytest.fixture(scope="module")
def vocab6_replay(vocab6_target, vocab6_drafts):
    """(case, sampling) -> replay(uniforms, accept, n_tokens) of PROMPT's rounds."""
    with torch.no_grad():
        prefill_logits = vocab6_target(PROMPT)[0][0, -1]
    tables = {}

    def make(case, sampling):
        draft = vocab6_drafts[case.draft]
        if case.scheme == "tree":
            key = (case, None)  # trees and target logits do not depend on the sampling
            tables.setdefault(key, tree_rounds(vocab6_target, draft, case.shape, case.preset))
            run, default_accept = replay_tree, E.accept_sampled
        else:
            key = (case, sampling)  # the drafter's q is warped like the target
            tables.setdefault(key, ChainRounds(vocab6_target, draft, sampling,
                                               case.shape.depth + 1))
            run, default_accept = replay_chain, E.accept_chain
        return lambda uniforms, accept=default_accept, n_tokens=N_TOKENS: run(
            prefill_logits, tables[key], sampling, uniforms, accept, n_tokens)
    return make


def monte_carlo(replay, uniforms, *accept):
    return [replay(uniforms, *accept) for _ in range(TRIALS)]


def accept_sampled_without_renormalising(logits, tree, uniforms, sampling):
    """p not renormalised after a rejection: sibling y kept with p(y)."""
    node, path, used = 0, [0], []
    p = E.warped_probs(logits[0], sampling)
    while True:
        for child in children(tree.parents, node):
            used.append(next(uniforms))
            x = int(tree.tokens[child])
            if used[-1] <= p[x]:
                break
            p[x] = 0
        else:
            break
        node = child
        path.append(node)
        p = E.warped_probs(logits[node], sampling)
    used.append(next(uniforms))
    return E.Acceptance(torch.tensor(path), len(path) - 1, E.sample_inverse_cdf(p, used[-1]), used)


def accept_sampled_bonus_ignoring_rejections(logits, tree, uniforms, sampling):
    """The bonus drawn from the last node's p, not the residual: a rejected draft can return."""
    acc = E.accept_sampled(logits, tree, uniforms, sampling)
    p = E.warped_probs(logits[int(acc.path[-1])], sampling)
    return acc._replace(bonus=E.sample_inverse_cdf(p, acc.uniforms[-1]))


def accept_chain_residual_ignoring_q(logits, drafts, q, uniforms, sampling):
    """After a rejection, the token drawn from p instead of norm(max(0, p - q))."""
    acc = E.accept_chain(logits, drafts, q, uniforms, sampling)
    p = E.warped_probs(logits[acc.accepted], sampling)
    return acc._replace(bonus=E.sample_inverse_cdf(p, acc.uniforms[-1]))


# ========================================================================================
# SPEC 5 (continued): sampling acceptance: hand-worked cases
# ========================================================================================

# Tree (node: token):   0:0 (root) -> 1:1 -> 3:3
#                                  -> 2:2
# HAND_P[i] is the target distribution after node i; logits = log p, so at temperature 1
# the warped distribution is exactly p.
HAND_P = torch.tensor([[0.10, 0.40, 0.30, 0.20],    # after node 0 (root)
                       [0.40, 0.30, 0.20, 0.10],    # after node 1
                       [0.05, 0.05, 0.10, 0.80],    # after node 2 (a leaf)
                       [0.70, 0.10, 0.10, 0.10]],   # after node 3 (a leaf)
                      dtype=torch.float64)


@pytest.mark.parametrize("uniforms, top_k, temperature, expected", [
    # node 1: .35 < p0(1) = .4 accept (node 2 never tried); node 3: .5 > p1(3) = .1 reject;
    # bonus .8 in the residual [.4, .3, .2, 0] / .9, CDF [.444, .778, 1, 1] -> token 2
    pytest.param([0.35, 0.5, 0.8], 0, 1.0, ([0, 1], 1, 2), id="first-child-accepted"),
    # node 1: .6 > .4 reject, p0 -> [1/6, 0, 1/2, 1/3]; node 2: .45 < 1/2 accept (the
    # unrenormalised .3 would reject); a leaf: bonus .6 in p2's CDF [.05, .1, .2, 1] -> 3
    pytest.param([0.6, 0.45, 0.6], 0, 1.0, ([0, 2], 1, 3),
                 id="second-child-tested-with-renormalised-probability"),
    # node 1: .6 > .4 reject, p0 -> [1/6, 0, 1/2, 1/3]; node 2: .7 > 1/2 reject, p0 ->
    # [1/3, 0, 0, 2/3]; bonus .4 in its CDF [1/3, 1/3, 1/3, 1] -> token 3 (the unmodified
    # p0, CDF [.1, .5, .8, 1], would give the rejected token 1)
    pytest.param([0.6, 0.7, 0.4], 0, 1.0, ([0], 0, 3),
                 id="all-children-rejected-bonus-from-residual"),
    # node 1: .35 < .4 accept; node 3: .05 < .1 accept; a leaf: bonus .75 in p3's CDF
    # [.7, .8, .9, 1] -> token 1 (node 1's CDF [.4, .7, .9, 1] would give token 2)
    pytest.param([0.35, 0.05, 0.75], 0, 1.0, ([0, 1, 3], 2, 1),
                 id="leaf-bonus-from-unmodified-distribution"),
    # top_k = 2: p0 -> [0, 4/7, 3/7, 0], p1 -> [4/7, 3/7, 0, 0]. node 1: .5 < 4/7 accept
    # (.5 > the unwarped .4); node 3: .01 > 0 reject (top-k removed token 3); residual = p1,
    # bonus .6 in its CDF [4/7, 1, 1, 1] -> token 1
    pytest.param([0.5, 0.01, 0.6], 2, 1.0, ([0, 1], 1, 1),
                 id="drafts-tested-against-warped-distribution"),
    # top_k = 2 gives token 3 probability 0 after node 1: it must be rejected whatever the
    # coin, also u = 0.0 (torch.rand draws from [0, 1); "accept iff u <= p(x)" takes 0 <= 0).
    # node 1: .5 < 4/7 accept; node 3: 0.0, reject; bonus .6 in CDF [4/7, 1, 1, 1] -> 1
    pytest.param([0.5, 0.0, 0.6], 2, 1.0, ([0, 1], 1, 1),
                 id="zero-probability-draft-never-accepted"),
    # logits = 0.5 log p at temperature 0.5 -> the warped distribution is p again, so the
    # renormalisation case above must come out unchanged
    pytest.param([0.6, 0.45, 0.6], 0, 0.5, ([0, 2], 1, 3), id="temperature-applied"),
])
def test_accept_sampled_on_the_hand_worked_tree(uniforms, top_k, temperature, expected):
    # logits = temperature * log p, so that the warped distribution is p (before top-k)
    tree = E.tree_from_parents(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]))
    stream = iter(uniforms)
    acc = E.accept_sampled(temperature * HAND_P.log(), tree, stream,
                           E.Sampling(temperature=temperature, top_k=top_k))
    assert next(stream, None) is None, "uniforms left unused"
    assert (acc.path.tolist(), acc.accepted, acc.bonus, acc.uniforms) == (*expected, uniforms)


# Chains: drafts x1, x2 sampled from the rows of q; p after the root, x1, x2.
CHAIN_Q = [[0.10, 0.60, 0.20, 0.10], [0.20, 0.20, 0.20, 0.40]]
CHAIN_P = [[0.25, 0.30, 0.25, 0.20], [0.10, 0.10, 0.10, 0.70], [0.10, 0.20, 0.30, 0.40]]


@pytest.mark.parametrize("p, q, drafts, top_k, uniforms, expected", [
    # x1 = 1: .45 * q(1) = .27 <= p(1) = .3 accept (.45 > p(1): a q = 1 rule rejects);
    # x2 = 3: .99 * .4 = .396 < .7 accept; bonus .5 in the last row's CDF [.1, .3, .6, 1] -> 2
    pytest.param(CHAIN_P, CHAIN_Q, [1, 3], 0, [0.45, 0.99, 0.5], ([0, 1, 2], 2, 2),
                 id="accepts-iff-u-times-q-below-p"),
    # x1 = 1: 0.6 * 0.6 = 0.36 > 0.3 -> reject; x2 is never tested
    # residual max(0, p - q) = [.15, 0, .05, .1] (sum .3): 0.52 * .3 = .156 in CDF
    #   [.15, .15, .2, .3] -> token 2 (p itself, CDF [.25, .55, ...], gives the rejected 1)
    pytest.param(CHAIN_P, CHAIN_Q, [1, 3], 0, [0.6, 0.52], ([0], 0, 2),
                 id="rejection-samples-residual-p-minus-q"),
    # x1 = 1: .45 * .6 = .27 < .3 accept; x2 = 3: .9 * q2(3) = .63 > p2(3) = .4 reject;
    # residual max(0, p2 - q2) = [.2, .1, 0, 0]: .7 * .3 = .21 in CDF [.2, .3, .3, .3] -> 1
    pytest.param([CHAIN_P[0], [0.30, 0.20, 0.10, 0.40], CHAIN_P[2]],
                 [CHAIN_Q[0], [0.10, 0.10, 0.10, 0.70]], [1, 3], 0, [0.45, 0.9, 0.7],
                 ([0, 1], 1, 1), id="second-rejection-uses-its-own-rows"),
    # top_k = 2: p = [.5, .3, .15, .05] -> [.625, .375, 0, 0]; the draft 2 (q(2) = .5) has
    # p = 0 and must be rejected also at u = 0.0 (which passes u * q(x) <= p(x) as 0 <= 0);
    # residual max(0, p - q) = [.425, .075, 0, 0] (sum .5): .5 * .5 = .25 -> token 0
    pytest.param([[0.5, 0.3, 0.15, 0.05], [0.25] * 4, [0.25] * 4],
                 [[0.2, 0.3, 0.5, 0.0], [0.25] * 4], [2, 0], 2, [0.0, 0.5], ([0], 0, 0),
                 id="zero-probability-draft-never-accepted"),
])
def test_accept_chain_on_hand_worked_chains(p, q, drafts, top_k, uniforms, expected):
    stream = iter(uniforms)
    acc = E.accept_chain(torch.tensor(p, dtype=torch.float64).log(), torch.tensor(drafts),
                         torch.tensor(q, dtype=torch.float64), stream,
                         E.Sampling(temperature=1.0, top_k=top_k))
    assert next(stream, None) is None, "uniforms left unused"
    assert (acc.path.tolist(), acc.accepted, acc.bonus, acc.uniforms) == (*expected, uniforms)


# ----------------------------------------------------------------------------------------
# warpers, inverse CDF, and replayable randomness


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.5, 5, 1.0), (1.0, 1, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.9),
    (0.5, 10, 0.8), (2.0, 3, 0.5), (0.9, 0, 0.05), (1.0, 50, 0.95), (1.2, 40, 1.0)])
def test_warped_probs_matches_transformers_warpers(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(int(temperature * 100) + top_k + int(top_p * 1000))
    logits = torch.randn(16, 40, generator=g) * 3
    if top_p == 1:
        # Rows with tied logits: top-k keeps every tie (a rule). Ties straddling the top-p
        # cut are left out: transformers drops whichever tied token its *unstable*
        # torch.sort puts first, which is not a rule eagle3_ref can match (see the report).
        logits = torch.cat([logits, torch.randint(-3, 4, (4, 40), generator=g).float()])
    sampling = E.Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    got = E.warped_probs(logits, sampling)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, hf_warped_probs(logits, sampling), rtol=0, atol=1e-12)


def test_warped_probs_top_p_drops_token_exactly_at_the_cut():
    # p = [8, 1, 4, 3] / 16, top_p = 0.75: ascending [1, 3, 4, 8] / 16, cumulative
    # [1/16, 4/16, 8/16, 1]; tokens whose cumulative stays <= 1 - 0.75 = 4/16 are dropped,
    # the one *at* 4/16 (token 3) included -> [8, 0, 4, 0] / 12
    logits = torch.tensor([8, 1, 4, 3], dtype=torch.float64).div(16).log()
    cumulative = logits.sort().values.softmax(-1).cumsum(-1)
    assert cumulative[1] == 1 - 0.75, "precondition: the cut is hit exactly in float64"
    sampling = E.Sampling(temperature=1.0, top_k=0, top_p=0.75)
    expected = torch.tensor([2 / 3, 0, 1 / 3, 0], dtype=torch.float64)
    torch.testing.assert_close(E.warped_probs(logits, sampling), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(hf_warped_probs(logits[None], sampling)[0], expected,
                               rtol=0, atol=1e-12)


def test_sample_inverse_cdf_on_a_hand_example_never_picks_a_zero_probability_token():
    p = torch.tensor([0.25, 0.0, 0.5, 0.125, 0.0, 0.125], dtype=torch.float64)
    # CDF [.25, .25, .75, .875, .875, 1]; token i owns [cdf(i-1), cdf(i)), empty for p = 0
    cases = {0.0: 0, 0.2: 0, 0.25: 2, 0.74: 2, 0.75: 3, 0.874: 3, 0.875: 5, 0.999: 5}
    assert {u: E.sample_inverse_cdf(p, u) for u in cases} == cases
    assert {u: E.sample_inverse_cdf(8 * p, u) for u in cases} == cases  # u scales with sum
    g = torch.Generator().manual_seed(0)             # never a zero-probability token
    below_one = float(np.nextafter(1.0, 0.0))
    for _ in range(50):
        p = torch.rand(12, generator=g, dtype=torch.float64)
        p[torch.rand(12, generator=g) < 0.5] = 0.0
        p[int(torch.randint(12, (1,), generator=g))] = 0.3  # at least one live token
        cdf = (p.cumsum(0) / p.sum()).tolist()
        for u in [0.0, below_one] + cdf + torch.rand(20, generator=g).tolist():
            token = E.sample_inverse_cdf(p, u)
            assert p[token] > 0, f"u={u} chose token {token} of probability 0 in {p.tolist()}"


@pytest.mark.parametrize("case_name", ["tree-2-2-5", "chain-2"])
def test_the_seed_alone_decides_the_tokens_and_the_trace_records_its_uniforms(
        case_name, vocab6_target, vocab6_drafts):
    case = CASES[case_name]

    def run(seed, n=24, **sampling):
        return E.speculative_generate(vocab6_target, vocab6_drafts[case.draft], PROMPT, n,
                                      tree=case.shape, seed=seed, **sampling,
                                      variant=E.resolve_variant(scheme=case.scheme))
    first, second = run(7, temperature=0.8, top_p=0.95), run(7, temperature=0.8, top_p=0.95)
    assert first.tokens.tolist() == second.tokens.tolist()
    assert first.accept_lengths == second.accept_lengths
    outputs = {tuple(run(seed, temperature=1.0).tokens.tolist()) for seed in range(4)}
    assert len(outputs) == 4  # 24 tokens of a 6-token vocab: a repeat is (almost) impossible
    for seed in range(5):     # the uniforms used, in order: the seeded stream, none skipped
        result = run(seed, 16, temperature=0.9, top_p=0.9)
        used = result.first_uniforms + [u for r in result.rounds for u in r.uniforms]
        assert used == list(itertools.islice(coins(seed), len(used)))


def test_sample_generate_replays_inverse_cdf_of_exact_law_and_its_first_token_fits_it(
        vocab6_target, vocab6_exact_law):
    # token i = inverse CDF, at the i-th seeded uniform, of transformers' warped
    # distribution given the tokens before it
    law = vocab6_exact_law(T07_P09)
    for seed in range(100):
        u1, u2, u3 = itertools.islice(coins(seed), 3)
        a = inverse_cdf(law.p1, u1)
        b = inverse_cdf(law.p2[a], u2)
        expected = [a, b, inverse_cdf(law.p3[a, b], u3)]
        got = E.sample_generate(vocab6_target, PROMPT, N_TOKENS, temperature=0.7, top_p=0.9,
                                seed=seed).tolist()
        assert got == expected, f"seed {seed}"

    every = dict(temperature=0.8, top_p=0.9, top_k=3, seed=5)  # every warper on, 24 tokens:
    assert torch.equal(*(E.sample_generate(vocab6_target, PROMPT, 24, **every)  # the same seed,
                         for _ in range(2)))                                    # the same tokens
    law = vocab6_exact_law(T1).p1           # and 1000 first tokens: chi-square against the law
    samples = [tuple(E.sample_generate(vocab6_target, PROMPT, 1, seed=seed).tolist())
               for seed in range(1000)]
    p = chi_square_p(samples, law)
    assert p >= ALPHA, f"sample_generate's first token deviates: p = {p:.2e}"


# ----------------------------------------------------------------------------------------
# tensor parallelism: rank 0 decides, every rank emits its decisions


def test_tensor_parallel_ranks_emit_rank0s_greedy_and_sampled_decisions(
        speculation, tp_run, vocab6_target, vocab6_drafts):
    s = speculation[TP_TARGETS[0]]                 # llama: its lm_head is not tied
    expected = s.reference["memorized"][:TP_NEW_TOKENS].tolist()
    rank0, rank1 = (rank["rank1_disagrees"] for rank in tp_run.ranks)
    assert not torch.equal(rank0["logits"].argmax(-1), rank1["logits"].argmax(-1)), \
        "rank 1's own choices must differ for this test to mean anything"
    assert rank0["greedy"].tolist() == rank1["greedy"].tolist() == expected
    for shape, (tokens0, _), (tokens1, _) in zip(TP_SHAPES, rank0["speculative"],
                                                  rank1["speculative"]):
        assert tokens0.tolist() == tokens1.tolist() == expected, shape
    # sampled, shared seed: both ranks emit W = 1's tokens; own seeds: rank 1 emits rank 0's
    single = tp_outputs(vocab6_target, vocab6_drafts["full"], TP_SEED)
    rank0, rank1 = (rank["sampled"]["shared"] for rank in tp_run.ranks)
    for name, tokens in single.items():
        assert rank0[name] == rank1[name], name
        assert rank0[name] == tokens, f"{name}: W = 2 differs from W = 1"
    rank0, rank1 = (rank["sampled"]["own seed"] for rank in tp_run.ranks)
    for name in ("tree", "plain"):                 # (not chain)
        assert rank1[name] == single[name], f"{name}: rank 1 decided"
        assert rank0[name] == single[name], name


TP_SEED = 11


def tp_outputs(target, draft, seed, generators=("tree", "chain", "plain")):
    """Sampled tokens of each generator, as the tensor-parallel tests compare them."""
    sampling = dict(temperature=0.9, top_p=0.9, seed=seed)
    run = dict(
        tree=lambda: E.speculative_generate(target, draft, PROMPT, 16, **sampling,
                                            tree=CASES["tree-2-2-5"].shape).tokens,
        chain=lambda: E.speculative_generate(target, draft, PROMPT, 16, **sampling,
                                             tree=CASES["chain-2"].shape,
                                             variant=E.resolve_variant(scheme="chain")).tokens,
        plain=lambda: E.sample_generate(target, PROMPT, 16, **sampling))
    return {name: run[name]().tolist() for name in generators}


def sampled_on_rank(target_dir, rank):
    """Per rank: samples with seed TP_SEED, and both samplers with a seed per rank."""
    tp_target = E.load_target(target_dir, dtype=torch.float32, device="cpu")
    tp_draft = vocab6_new_draft(tp_target, seed=1)
    return {"shared": tp_outputs(tp_target, tp_draft, TP_SEED),
            "own seed": tp_outputs(tp_target, tp_draft, TP_SEED + 100 * rank, ("tree", "plain"))}


# ----------------------------------------------------------------------------------------
# variant: batches of prompts of different lengths, one verify forward for all trees

BATCH_PROMPTS = [random_prompt(700 + i, length=L) for i, L in enumerate((6, 9, 7, 12))]


@pytest.mark.parametrize("preset", list(E.PRESETS))
def test_each_presets_greedy_speculation_alone_and_in_batches_equals_greedy_decoding(
        speculation, preset):
    variant = E.resolve_variant(preset)
    for name in ("llama", "qwen3"):
        s = speculation[name]
        for kind in ("memorized", "fresh"):
            result = E.speculative_generate(s.target, s.draft, s.prompts[kind], 32,
                                            tree=E.TreeShape(3, 3, 12), variant=variant)
            assert result.tokens.tolist() == s.reference[kind][:32].tolist(), (name, kind)
    # Batches whose last row drafts deep: 4 prompts; and an 8- and a 9-token prompt on a short
    # chain, where the 9-token row finishes first, often committing past its budget in its
    # last round; it then rides along in the batched verify, padded to the widest tree, so
    # the cache must hold that too (it once wrote past the end: "expanded size 3 vs 4").
    s = speculation["llama"]
    memorized = torch.cat([s.prompts["memorized"], s.reference["memorized"][None, :1]], 1)
    pair = [s.prompts["fresh"], memorized]
    assert [p.shape[1] for p in pair] == [8, 9]
    batches = [(BATCH_PROMPTS[:3] + [s.prompts["memorized"]], (3, 3, 12), 24)]
    for prompts, shape, max_new in batches + [(pair, (1, 2, 4), n) for n in (28, 29, 30, 31)]:
        batch = E.speculative_generate_batch(s.target, s.draft, prompts, max_new,
                                             tree=E.TreeShape(*shape), variant=variant)
        for ids, r in zip(prompts, batch):
            assert r.tokens.tolist() == hf_greedy(s.hf, ids, max_new).tolist()
        assert max(batch[-1].accept_lengths) >= 3            # its drafts were accepted
        assert prompts is not pair or len(batch[1].rounds) < len(batch[0].rounds)  # finished first


@pytest.mark.parametrize("preset", list(E.PRESETS))
def test_batch_sampled_rows_equal_their_own_runs_with_seed_plus_row(speculation, preset):
    # row b draws from its own generator seeded seed + b, so it is exactly the batch-1 run
    # with that seed: each row keeps the (tested lossless) distribution of a single run
    s, run = speculation["qwen3"], dict(temperature=0.9, top_k=8, tree=E.TreeShape(2, 2, 7),
                                        variant=E.resolve_variant(preset))
    results = E.speculative_generate_batch(s.target, s.draft, BATCH_PROMPTS, 16, seed=40, **run)
    for b, (ids, r) in enumerate(zip(BATCH_PROMPTS, results)):
        single = E.speculative_generate(s.target, s.draft, ids, 16, seed=40 + b, **run)
        assert r.tokens.tolist() == single.tokens.tolist(), b
        assert r.accept_lengths == single.accept_lengths


# ========================================================================================
# SPEC 10. presets: the engines' conventions (SGLang, vLLM) and the official warper order
# ========================================================================================

ORDERS = {"T-k-p": E.TRANSFORMERS_ORDER, "T-p-k": E.OFFICIAL_ORDER}  # the warpers' order
T1_K4_P08 = {order: E.Sampling(temperature=1.0, top_k=4, top_p=0.8, warpers=ORDERS[order])
             for order in ORDERS}   # both warpers on: their order matters


def test_official_warper_order_is_top_p_before_top_k():
    # the official EAGLE code warps temperature -> top-p -> top-k; transformers (and SGLang,
    # vLLM) temperature -> top-k -> top-p. On these logits the two keep different tokens.
    # p = [.4, .2, .1, .1, .1, .1], top-k 2, top-p 0.5: top-p first keeps {0, 1} (.4 < .5),
    # then top-k keeps both; top-k first renormalises {0, 1} to [2/3, 1/3], and top-p keeps 0
    logits = torch.tensor([[0.4, 0.2, 0.1, 0.1, 0.1, 0.1]], dtype=torch.float64).log()
    warped = {}
    for order in ("T-k-p", "T-p-k"):
        sampling = E.Sampling(temperature=1.0, top_k=2, top_p=0.5, warpers=ORDERS[order])
        warped[order] = E.warped_probs(logits, sampling)
        torch.testing.assert_close(warped[order], hf_warped_probs(logits, sampling), rtol=0,
                                   atol=1e-12)
    assert warped["T-p-k"][0].tolist() == pytest.approx([2 / 3, 1 / 3, 0, 0, 0, 0])
    assert warped["T-k-p"][0].tolist() == pytest.approx([1, 0, 0, 0, 0, 0])
    assert E.PRESETS["official"].warpers == ORDERS["T-p-k"]
    assert E.PRESETS["sglang"].warpers == E.PRESETS["vllm"].warpers == ORDERS["T-k-p"]


# hand-worked SGLang tree sampling: tree 0 -> {1, 2}, 1 -> {3}; node i holds token i.
# p rows (fp32-exact binary fractions) are the target's distribution after each node.
SG_P = torch.tensor([[0.125, 0.5, 0.25, 0.125],    # after the root
                     [0.5, 0.25, 0.125, 0.125],    # after node 1
                     [0.25, 0.25, 0.25, 0.25],     # after node 2 (a leaf)
                     [0.0, 0.5, 0.5, 0.0]])        # after node 3 (a leaf)
SG_TREE = E.tree_from_parents(torch.tensor([0, 1, 2, 3]), torch.tensor([-1, 0, 0, 1]))


@pytest.mark.parametrize("coins, final, ts, ta, expected", [
    # root coin 0.6: node 1 (token 1) mass 0.5 < 0.6 -> reject; node 2 mass 0.75 >= 0.6 ->
    # accept. Node 2 is a leaf: bonus from p2 (nothing rejected there), final 0.3 * 1 = 0.3 in
    # CDF [.25, .5, .75, 1] -> token 1. Node 2's coin (0.99) is never used.
    pytest.param([0.6, 0.0, 0.99, 0.0], 0.3, 1.0, 1.0, ([0, 2], 1, 1),
                 id="rejects-a-sibling-then-accepts-the-next-on-the-same-coin"),
    # root coin 0.25 <= 0.5 -> node 1; node 1's coin 0.1 <= p1(3) = 0.125 -> node 3 (depth 2,
    # the tree's full depth): bonus from p3 unmodified, 0.75 * 1 in CDF [0, .5, 1, 1] -> 2
    pytest.param([0.25, 0.1, 0.0, 0.0], 0.75, 1.0, 1.0, ([0, 1, 3], 2, 2),
                 id="full-depth-path-draws-the-bonus-from-the-leaf"),
    # root coin 0.9 > 0.5 and > 0.75: both rejected; r = p0 - [0, .5, .25, 0] = [.125, 0, 0,
    # .125] (not renormalised): final 0.6 * 0.25 = 0.15 in CDF [.125, .125, .125, .25] -> 3
    pytest.param([0.9, 0.0, 0.0, 0.0], 0.6, 1.0, 1.0, ([0], 0, 3),
                 id="all-children-rejected-bonus-from-the-unnormalised-residual"),
    # coin exactly 0.5 = p0(1): accepted ("<="); node 1's coin 0.5 > 0.125 -> node 3 rejected;
    # r = p1 - [0, 0, 0, .125]: 0.99 * .875 = .866 in CDF [.5, .75, .875, .875] -> token 2
    pytest.param([0.5, 0.5, 0.0, 0.0], 0.99, 1.0, 1.0, ([0, 1], 1, 2),
                 id="accepts-on-equality-coin-le-mass"),
    # lossy thresholds accept beyond p: coin 0.9 rejects node 1 at the default thresholds ...
    pytest.param([0.9, 0.9, 0.0, 0.0], 0.0, 1.0, 1.0, ([0], 0, 0), id="default-thresholds"),
    # ... threshold_single 0.4: p0(1) = 0.5 >= 0.4 accepts outright (then p1(3) = .125 < .4)
    pytest.param([0.9, 0.9, 0.0, 0.0], 0.0, 0.4, 1.0, ([0, 1], 1, 0), id="threshold-single"),
    # ... threshold_acc 0.5: 0.9 <= 0.5 / 0.5 accepts node 1; node 1: 0.9 > 0.125 / 0.5
    pytest.param([0.9, 0.9, 0.0, 0.0], 0.0, 1.0, 0.5, ([0, 1], 1, 0), id="threshold-acc"),
])
def test_sglang_tree_sampling_on_the_hand_worked_tree(coins, final, ts, ta, expected):
    acc = E.accept_cumulative(SG_P, SG_TREE, torch.tensor(coins), torch.tensor(final), ts, ta)
    assert (acc.path.tolist(), acc.accepted, acc.bonus) == expected


def test_cdf_pick_sums_in_float64_and_rounds_each_prefix_to_fp32():
    # The reference: a Python float (double) running sum, each prefix rounded to fp32, and
    # fp32 coin * total. Coins sit on the boundaries where a plain fp32 running sum (CUDA's
    # cumsum) would pick another token.
    r = torch.rand(3000, generator=torch.Generator().manual_seed(0))
    r[r < 0.2] = 0
    exact, fp32, acc, acc32 = [], [], 0.0, np.float32(0)
    for x in r.tolist():
        acc, acc32 = acc + x, np.float32(acc32 + np.float32(x))
        exact.append(np.float32(acc))
        fp32.append(acc32)

    def pick(prefix, coin):
        bound = np.float32(coin) * prefix[-1]
        return next(i for i, (c, x) in enumerate(zip(prefix, r.tolist())) if c > bound and x > 0)

    differ = [i for i in range(len(r)) if exact[i] != fp32[i] and r[i] > 0]
    assert differ, "no boundary where the two sums differ"
    checked = 0
    for i in differ[::50]:
        coin = np.float32(exact[i] / exact[-1])
        for c in (np.nextafter(coin, np.float32(0)), coin, np.nextafter(coin, np.float32(1))):
            got = E.cdf_pick(r, torch.tensor(c))
            assert got == pick(exact, c), (i, c)
            checked += got != pick(fp32, c)
    assert checked, "no coin separates the float64 sum from a plain fp32 one"


# hand-worked vLLM rejection sampling of a chain of argmax drafts (q one-hot)
VL_P = torch.tensor([[0.125, 0.5, 0.25, 0.125],    # at draft 1 (token 1)
                     [0.5, 0.25, 0.125, 0.125],    # at draft 2 (token 3)
                     [0.25, 0.25, 0.25, 0.25]])    # after both: the bonus position
VL_E = torch.tensor([1.0, 0.1, 2.0, 0.5])         # the request's Exp(1) vector


@pytest.mark.parametrize("uniforms, bonus, expected", [
    # draft 1: p(1) = 0.5 >= 0.5 accepts (">=" : equality accepts); draft 2: p(3) = .125 < 0.2
    # rejects; r = p2 with token 3 zeroed = [.5, .25, .125, 0]; r / E = [.5, 2.5, .0625, 0]
    # -> argmax 1, though p2's own argmax is token 0
    pytest.param([0.5, 0.2], 3, ([0, 1], 1, 1),
                 id="accepts-iff-p-at-least-u-and-recovers-argmax-r-over-e"),
    # both drafts accepted: the presampled bonus is emitted
    pytest.param([0.5, 0.1], 2, ([0, 1, 2], 2, 2), id="all-accepted-emit-the-presampled-bonus"),
    # draft 1 rejected (0.4 < 0.6): r = p1 with token 1 zeroed = [.125, 0, .25, .125];
    # r / E = [.125, 0, .125, .25] -> token 3 (token 1 would win with p / E: 5.0)
    pytest.param([0.6, 0.0], 0, ([0], 0, 3), id="first-rejection-zeroes-the-draft-in-r"),
])
def test_vllm_rejection_sampling_on_the_hand_worked_chain(uniforms, bonus, expected):
    acc = E.accept_onehot(VL_P, torch.tensor([1, 3]), torch.tensor(uniforms, dtype=torch.float64),
                          VL_E, bonus=bonus)
    assert (acc.path.tolist(), acc.accepted, acc.bonus) == expected


# ----------------------------------------------------------------------------------------
# sampled speculation is lossless, official and the engines': chi-square against the
# enumeration, the real loop replayed

TKP, TPK = T1_K4_P08["T-k-p"], T1_K4_P08["T-p-k"]
PRESET_CASES = {  # name -> (Case, sampling)
    "sglang-tree-2-2-5": (Case("tree", E.TreeShape(2, 2, 5), "full", "sglang", True), TKP),
    "sglang-tree-3-1-4-vd4": (Case("tree", E.TreeShape(3, 1, 4), "vd4", "sglang", True), TKP),
    "vllm-chain-3": (Case("tree", E.TreeShape(1, 2, 4), "full", "vllm", True), TKP),
    "official-tree-2-2-5": (Case("tree", E.TreeShape(2, 2, 5), "full", "official", True), TPK),
}
LOSSLESS = {f"{c}-{s}": (CASES[c], SAMPLINGS[s]) for c in CASES for s in SAMPLINGS} | PRESET_CASES


def preset_accept(preset, generator, **overrides):
    """The preset's acceptance (`overrides` applied), drawing from `generator` as the real loop."""
    chosen = E.PRESETS[preset]._replace(**overrides)

    def accept(logits, tree, uniforms, sampling):
        run = E.Run(E.TreeShape(), sampling, False, E.resolve_variant(chosen))
        return E.decide(logits, tree, None, run, generator, E.LOCAL)[0]
    return accept


def draws(case, seed, *broken):
    """(uniforms, accept) of a replay: the documented coins() stream with the scheme's own
    acceptance (or `broken`), or, for an engine's case, both drawing from the one generator
    its real loop seeds with `seed` (`broken` then makes the acceptance of that generator)."""
    if not case.engine:
        return (coins(seed), *broken)
    g = torch.Generator().manual_seed(seed)
    return E.uniform_stream(g), (broken[0] if broken else preset_accept)(case.preset, g)


def sglang_residual_ignoring_rejections(preset, generator):
    """Broken: the final token drawn from p itself, as if no child had been rejected."""
    def accept(logits, tree, uniforms, sampling):
        p = E.warped_probs(logits, sampling).float()
        coins, final = torch.rand(len(tree.tokens), generator=generator), \
            torch.rand(1, generator=generator)
        acc = E.accept_cumulative(p, tree, coins, final[0])
        node = int(acc.path[-1])
        return acc._replace(bonus=E.cdf_pick(p[node], final[0]))
    return accept


def vllm_recovered_keeping_the_draft(preset, generator):
    """Broken: the recovered token drawn from p without zeroing the rejected draft."""
    def accept(logits, tree, uniforms, sampling):
        p = E.warped_probs(logits, sampling).float()
        V = p.shape[-1]
        bonus_e = torch.empty(V).exponential_(generator=generator)
        u = torch.rand(len(tree.tokens) - 1, dtype=torch.float64, generator=generator)
        e = torch.empty(V).exponential_(generator=generator)
        for i, x in enumerate(tree.tokens[1:].tolist()):
            if float(p[i, x]) < float(u[i]):
                return E.Acceptance(torch.arange(i + 1), i, int((p[i] / e).argmax()), [])
        return E.Acceptance(torch.arange(len(u) + 1), len(u), int((p[-1] / bonus_e).argmax()),
                            [])
    return accept


def sglang_lossy_threshold_acc(preset, generator):
    """SGLang's own threshold_acc 0.5: accepts beyond p, so the distribution changes."""
    return preset_accept(preset, generator, threshold_acc=0.5)


@pytest.mark.parametrize("name", LOSSLESS)
def test_sampled_speculation_is_lossless_and_the_real_loop_replays_round_by_round(
        name, vocab6_target, vocab6_drafts, vocab6_replay, vocab6_exact_law):
    case, s = LOSSLESS[name]
    replay = vocab6_replay(case, s)
    p = chi_square_p(monte_carlo(replay, *draws(case, 2024)), vocab6_exact_law(s).joint)
    assert p >= ALPHA, f"{name}: first {N_TOKENS} tokens deviate from the exact law (p = {p:.2e})"
    # the real loop draws its random numbers as the replay does, so the chi-square samples
    # speculative_generate itself, seed for seed (many rounds)
    for seed in range(REPLAY_SEEDS):
        result = E.speculative_generate(
            vocab6_target, vocab6_drafts[case.draft], PROMPT, REPLAY_TOKENS,
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, tree=case.shape, seed=seed,
            variant=E.resolve_variant(case.preset, case.scheme))
        expected = replay(*draws(case, seed), n_tokens=REPLAY_TOKENS)
        assert tuple(result.tokens.tolist()) == expected, f"seed {seed}"


@pytest.mark.parametrize("case, sampling, broken", [
    (CASES["tree-3-1-4-vd4"], T1, accept_sampled_without_renormalising),
    (CASES["tree-2-2-5"], T1, accept_sampled_bonus_ignoring_rejections),
    (CASES["chain-2"], T1, accept_chain_residual_ignoring_q),
    (*PRESET_CASES["sglang-tree-2-2-5"], sglang_residual_ignoring_rejections),
    (*PRESET_CASES["sglang-tree-2-2-5"], sglang_lossy_threshold_acc),
    (*PRESET_CASES["vllm-chain-3"], vllm_recovered_keeping_the_draft)],
    ids=lambda x: getattr(x, "__name__", None))
def test_chi_square_rejects_broken_acceptance(case, sampling, broken, vocab6_replay,
                                              vocab6_exact_law):
    samples = monte_carlo(vocab6_replay(case, sampling), *draws(case, 2024, broken))
    p = chi_square_p(samples, vocab6_exact_law(sampling).joint)
    assert p < ALPHA, f"{broken.__name__} passed the losslessness test (p = {p:.2e})"


def test_sglang_product_scores_grow_the_official_tree_and_pre_25015_positions_are_one_late():
    # SGLang multiplies fp32 probabilities where the official code adds log-probabilities:
    # the same ranking, so the same tree. Level j's tokens are consumed at position
    # n + j - 1 (official, SGLang since PR #25015), one later before it.
    h_last, root = F.one_hot(torch.tensor([0]), 6).float(), torch.tensor(0)
    tree, official = (grow(MarkovDrafter(HAND_TABLE), None, 3, h_last, root,
                           E.TreeShape(2, 2, 6), preset) for preset in ("sglang", "official"))
    assert tree.tokens.tolist() == official.tokens.tolist()       # same order, other space
    assert tree.parents.tolist() == official.parents.tolist()
    for offset in (0, 1):
        drafter = MarkovDrafter(HAND_TABLE)
        grow(drafter, None, 10, h_last, root, E.TreeShape(2, 3, 8), "sglang",
             draft_pos_offset=offset)
        assert [c["positions"] for c in drafter.calls] == [[10 + offset] * 2, [11 + offset] * 2,
                                                           [12 + offset] * 2]


# ========================================================================================
# SPEC 10 (continued): the engines' own test cases, reproduced from their inputs (the commit each was read at is named)
# ========================================================================================

# The engines' own output functions, restated from their inputs over eagle3_ref's trees and
# acceptance: what their tests compare.


def sglang_build_tree(score_list, token_list, parents_list, verified_id, seq_lens, topk,
                      num_draft_tokens):
    """SGLang's organize_draft_results + build_tree_kernel_efficient, each step's inputs
    (nested lists) indexed by request -> its outputs as lists, and each tree's mask."""
    out = dict(positions=[], retrive_index=[], retrive_next_token=[], retrive_next_sibling=[],
               draft_tokens=[], mask=[])
    for b in range(len(verified_id)):
        scores = torch.cat([torch.tensor(x[b]).flatten() for x in score_list])
        tokens = torch.cat([torch.tensor(x[b]).flatten() for x in token_list])
        group_parent = torch.cat([torch.tensor(x[b]) for x in parents_list[:-1]])
        tree = E.select_tree(scores, tokens, group_parent, torch.tensor(verified_id[b]),
                             num_draft_tokens, topk)
        lists = E.sglang_tree(tree)
        out["positions"] += (seq_lens[b] + tree.positions).tolist()
        out["retrive_index"].append(list(range(b * num_draft_tokens, (b + 1) * num_draft_tokens)))
        out["retrive_next_token"].append(lists["retrive_next_token"].tolist())
        out["retrive_next_sibling"].append(lists["retrive_next_sibling"].tolist())
        out["draft_tokens"] += tree.tokens.tolist()
        out["mask"].append(tree.mask.int().tolist())
    return out


def sglang_linked_tree(tokens, next_token, next_sibling):
    """A Tree, each node's children in SGLang's visiting order, from linked lists."""
    N = len(tokens)
    parents, kids = torch.full((N,), -1), [[] for _ in range(N)]
    for node in range(N):
        child = int(next_token[node])
        while child != -1:
            parents[child] = node
            kids[node].append(child)
            child = int(next_sibling[child])
    return E.tree_from_parents(torch.as_tensor(tokens), parents), kids


def sglang_verify_outputs(accepts, retrive_index, num_spec_step):
    """SGLang's verify outputs (predicts, accept_index, accept_token_num) from Acceptances."""
    B, N = retrive_index.shape
    predicts = torch.full((B * N,), -1)
    accept_index = torch.full((B, num_spec_step), -1)
    for b, (acc, tokens) in enumerate(accepts):
        path = retrive_index[b, acc.path]
        accept_index[b, :len(path)] = path
        predicts[path[:-1]] = tokens[acc.path[1:]]
        predicts[path[-1]] = acc.bonus
    return predicts, accept_index, torch.tensor([acc.accepted for acc, _ in accepts])


def vllm_greedy_output(drafts, target_argmax, bonus, max_spec_len):
    """vLLM's greedy rejection-sampler output (-1 padded), verified as a chain of one-hots."""
    out = torch.full((len(drafts), max_spec_len + 1), -1)
    for b, (d, t, x) in enumerate(zip(drafts, target_argmax, bonus)):
        chain = E.tree_from_parents(torch.tensor([0] + list(d)), torch.arange(-1, len(d)))
        rows = torch.tensor(list(t) + [x])
        logits = F.one_hot(rows, int(max(rows.max(), max(d, default=0))) + 1).float()
        acc = E.accept_greedy(logits, chain)
        emitted = list(d[:acc.accepted]) + [acc.bonus]
        out[b, :len(emitted)] = torch.tensor(emitted)
    return out


SGL_SCORES = [  # build_eagle_tree.py self-test, sglang@009db01a: bs 2, topk 4, 4 steps, ndt 8
    [[[7.1127e-01, 2.8292e-01, 2.2995e-03, 1.7357e-03]],
     [[9.7476e-01, 2.2219e-02, 6.5031e-04, 1.3212e-04]]],
    [[[6.9142e-01, 1.2863e-02, 1.6873e-03, 1.1871e-03],
      [2.4787e-01, 1.8818e-02, 1.4204e-02, 9.2235e-04],
      [2.2971e-03, 1.6700e-06, 1.8737e-07, 8.3146e-08],
      [1.2771e-03, 2.4374e-04, 1.7832e-04, 1.1947e-05]],
     [[8.4832e-02, 6.6068e-02, 5.8304e-02, 5.7851e-02],
      [2.3616e-03, 1.1243e-03, 5.4368e-04, 2.7768e-04],
      [2.5286e-04, 1.5578e-04, 2.8817e-05, 1.2888e-05],
      [1.2834e-04, 2.5417e-06, 1.1279e-06, 1.6088e-08]]],
    [[[6.6438e-01, 2.6997e-02, 2.4236e-05, 4.0821e-06],
      [2.4402e-01, 2.8409e-03, 5.0935e-04, 2.9022e-04],
      [1.6178e-02, 2.0567e-03, 4.5892e-04, 3.0034e-05],
      [1.3023e-02, 5.0497e-04, 3.6371e-04, 8.7750e-05]],
     [[2.3263e-02, 2.0054e-02, 9.3990e-03, 2.7783e-03],
      [6.4156e-02, 5.5506e-04, 1.0429e-04, 9.7211e-05],
      [4.9950e-02, 5.0630e-03, 9.0068e-04, 3.3656e-04],
      [7.5817e-03, 8.5731e-04, 6.9972e-04, 6.0793e-04]]],
    [[[6.6420e-01, 1.0525e-04, 6.5864e-05, 1.2253e-06],
      [1.3019e-01, 1.0461e-01, 5.2083e-03, 1.6777e-03],
      [2.0103e-02, 6.7335e-03, 1.2625e-04, 1.0364e-05],
      [1.5142e-02, 7.0819e-04, 9.6595e-05, 8.7951e-05]],
     [[5.8608e-02, 1.8840e-03, 7.8535e-04, 4.4400e-04],
      [1.2185e-02, 2.0684e-03, 1.7418e-03, 1.4327e-03],
      [6.2455e-03, 6.1487e-03, 2.6862e-03, 1.8034e-03],
      [1.8590e-03, 1.6151e-03, 1.2481e-03, 3.6038e-04]]]]
SGL_TOKENS = [
    [[29896, 29906, 29900, 29945], [13, 2, 29871, 28956]],
    [[29889, 29974, 29945, 29900, 29974, 29922, 29930, 29958, 29889, 29974, 29930, 29945,
      29974, 29922, 29930, 29958],
     [22550, 4136, 16492, 8439, 29871, 2, 3001, 13, 2, 13, 29906, 29946, 2, 13, 29871, 259]],
    [[29946, 29945, 29953, 29906, 29896, 29945, 29900, 29906, 29896, 29945, 29906, 29953,
      29896, 29945, 29906, 29946],
     [29871, 2, 29901, 29889, 29871, 2, 395, 259, 29901, 29871, 2, 29889, 3001, 1234, 7146,
      2186]],
    [[29946, 29974, 29945, 29930, 29889, 29922, 29974, 29930, 29974, 29946, 29930, 29922,
      29889, 29974, 29945, 29922],
     [29941, 29906, 2, 29946, 29871, 450, 319, 14990, 29946, 29941, 2, 29906, 29871, 2, 3001,
      13]]]
SGL_PARENTS = [[[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]], [[4, 8, 9, 10], [4, 5, 6, 7]],
               [[20, 24, 21, 28], [24, 28, 20, 21]], [[36, 40, 41, 44], [36, 40, 44, 45]]]


SGL_TREES = {  # name -> (sglang_build_tree's inputs, the outputs its test expects)
    "build_eagle_tree.py": (  # the self-test, sglang@009db01a: bs 2, topk 4, 4 steps, ndt 8
        (SGL_SCORES, SGL_TOKENS, SGL_PARENTS, [29974, 13], [5, 10], 4, 8), dict(
            positions=[5, 6, 6, 7, 7, 8, 8, 9, 10, 11, 12, 12, 12, 12, 13, 14],
            retrive_index=[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
            retrive_next_token=[[1, 3, 4, 5, 6, 7, -1, -1], [1, 2, -1, 6, -1, -1, 7, -1]],
            retrive_next_sibling=[[-1, 2, -1, -1, -1, -1, -1, -1], [-1, -1, 3, 4, 5, -1, -1, -1]],
            draft_tokens=[29974, 29896, 29906, 29889, 29974, 29946, 29896, 29946, 13, 13, 22550,
                          4136, 16492, 8439, 29871, 29941])),
    # test/srt/cpu/test_spec_kernels.py, sglang@3da9e7e6: topk 2, 2 steps, 4 draft tokens;
    # the pool is given by its selected indices: scores that select exactly them
    "cpu-topk-2": (([[[[0.6, 0.3]]], [[[0.5, 0.1], [0.05, 0.01]]]], [[[1, 2]], [[3, 4, 5, 6]]],
                    [[[-1, 0, 1]], [[2, 3]]], [0], [5], 2, 4), dict(
        retrive_next_token=[[1, 3, -1, -1]], retrive_next_sibling=[[-1, 2, -1, -1]],
        positions=[5, 6, 6, 7], mask=[[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]])),
    # the topk = 1 chain, 3 steps: seq_lens 7 and 12, a causal mask, consecutive positions
    "cpu-chain": (([[[[0.9]], [[0.9]]], [[[0.8]], [[0.8]]], [[[0.7]], [[0.7]]]],
                   [[[1], [1]], [[2], [2]], [[3], [3]]],
                   [[[-1, 0], [-1, 0]], [[1], [1]], [[2], [2]]], [0, 0], [7, 12], 1, 4), dict(
        positions=[7, 8, 9, 10, 12, 13, 14, 15], mask=[torch.ones(4, 4).tril().int().tolist()] * 2,
        retrive_next_token=[[1, 2, 3, -1]] * 2)),
}


@pytest.mark.parametrize("name", SGL_TREES)
def test_sglang_preset_reproduces_sglangs_tree_building_tests(name):
    inputs, expected = SGL_TREES[name]
    out = sglang_build_tree(*inputs)
    assert {key: out[key] for key in expected} == expected


SGL_CANDIDATES = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]  # test_eagle_utils.py, sglang@9bfd52e8
SGL_RETRIVE_INDEX = [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
SGL_NEXT_TOKEN = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
SGL_NEXT_SIBLING = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]


def sglang_test_logits():
    """Logits (2, 6, 20): 1; 10 at a few (request, node, token), else at token 18."""
    logits = torch.ones(2, 6, 20)
    for b, node, token in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        logits[b, node, token] = 10
    logits[..., 18][logits.max(-1).values < 10] = 10
    return logits


def sglang_test_run(accept):
    """accept(logits (6, 20), Tree, order) for both requests; SGLang's tensors."""
    logits, accepts = sglang_test_logits(), []
    for b in range(2):
        tree, kids = sglang_linked_tree(SGL_CANDIDATES[b], SGL_NEXT_TOKEN[b],
                                          SGL_NEXT_SIBLING[b])
        accepts.append((accept(logits[b], tree, kids), tree.tokens))
    predicts, index, num = sglang_verify_outputs(accepts, torch.tensor(SGL_RETRIVE_INDEX), 4)
    return predicts.tolist(), index.tolist(), num.tolist()


@pytest.mark.parametrize("ts, ta, predicts, index, num", [   # test_speculative_sampling.py
    (None, None, [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5],
                                                                [6, 10, 11, -1]], [3, 2]),
    (1, 1, [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]],
     [3, 2]),
    (0, 0, [1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]],
     [2, 2]),
])
def test_sglang_preset_reproduces_sglangs_verify_and_tree_sampling_kernel_tests(ts, ta,
                                                                               predicts, index,
                                                                               num):
    # ts None: the greedy verify kernel's test (test_eagle_utils.py). Otherwise temperature
    # 0.01 makes the fp32 probabilities exactly one-hot, so any coins give the test's
    # outputs; its hand-written linked lists visit the root's children 4 before 1.
    g = torch.Generator().manual_seed(0)

    def accept(logits, tree, kids):
        if ts is None:
            return E.accept_greedy(logits, tree)
        p = torch.softmax(logits / 0.01, -1)
        return E.accept_cumulative(p, tree, torch.rand(6, generator=g),
                                   torch.rand((), generator=g), ts, ta, kids=kids)
    assert sglang_test_run(accept) == (predicts, index, num)


def test_sglang_preset_reproduces_sglangs_cpu_greedy_chain_case():
    # test/srt/cpu/test_spec_kernels.py, sglang@3da9e7e6: drafts 3, 4, 5 after the root 10;
    # targets 3, 4, 9, 9
    chain, _ = sglang_linked_tree([10, 3, 4, 5], [1, 2, 3, -1], [-1, -1, -1, -1])
    acc = E.accept_greedy(F.one_hot(torch.tensor([3, 4, 9, 9]), 12).float(), chain)
    outputs = sglang_verify_outputs([(acc, chain.tokens)], torch.tensor([[0, 1, 2, 3]]), 4)
    assert [x.tolist() for x in outputs] == [[3, 4, 9, -1], [[0, 1, 2, -1]], [2]]


@pytest.mark.parametrize("drafts, targets, bonus, expected", [  # vLLM test_rejection_sampler.py
    ([[1, 2, 3]], [[1, 2, 3]], [4], [[1, 2, 3, 4]]),                    # perfect match
    ([[1, 2, 3]], [[1, 5, 3]], [4], [[1, 5, -1, -1]]),                  # early mismatch
    ([[1, 2], [3]], [[1, 2], [3]], [5, 4], [[1, 2, 5], [3, 4, -1]]),    # multiple sequences
    ([[1]], [[1]], [2], [[1, 2]]),                                      # single token
    ([[]], [[]], [5], [[5]]),                                           # empty sequence
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8, 6]], [6, 9],
     [[1, 2, 7, -1], [4, 8, -1, -1]]),                                  # multiple mismatches
    ([[1, 2]], [[1, 2]], [3], [[1, 2, 3]]),                             # parametrized 1
    ([[1]], [[2]], [3], [[2, -1]]),                                     # parametrized 2
    ([[1, 2], [3, 4]], [[1, 5], [3, 4]], [6, 7], [[1, 5, -1], [3, 4, 7]]),  # parametrized 3
])
def test_vllm_preset_reproduces_vllms_greedy_rejection_sampler_tests(drafts, targets, bonus,
                                                                     expected):
    max_spec_len = max(len(d) for d in drafts)
    assert vllm_greedy_output(drafts, targets, bonus, max_spec_len).tolist() == expected


# ========================================================================================
# SPEC 6. training: vocab mapping, the TTT loss, data parallelism, resume, offline features
# ========================================================================================

TRAIN_VOCAB = 32         # target vocab of the in-process training tests
TRAIN_DRAFT_VOCAB = 16   # draft vocab < target vocab, so d2t/t2d and the position mask matter
TRAIN_LAYERS = 8         # aux layers (2, L//2, L-3) = (2, 4, 5)
TRAIN_PAD = 0


def train_randomize(draft, seed, std=0.2):
    """Weights large enough that a wrong mask shows, norm gains != 1 (swapped norms)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(torch.randn(p.shape, generator=g) * std + (1.0 if p.dim() == 1 else 0.0))
    return draft


def train_collate(examples, pad_id):
    """Right-padded ids; step-0 loss_mask[t] = 1 iff x[t+2] (t predicts it) is a reply."""
    T = max(len(ex.tokens) for ex in examples)
    ids = torch.full((len(examples), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(examples), T)
    for i, ex in enumerate(examples):
        ids[i, :len(ex.tokens)] = torch.tensor(ex.tokens)
        for t in range(len(ex.tokens) - 2):
            mask[i, t] = ex.reply_mask[t + 2]
    return ids, mask


def train_reference_ttt(draft, aux, input_ids, loss_mask, target_logits, steps, decay=0.8):
    """The TTT loss on reference_drafter's steps -> (total, losses, hits, counts, floor); the
    floor, the lowest loss any drafter could reach, is the restricted teacher's entropy."""
    t2d = draft.t2d.detach()
    B, T = input_ids.shape
    total, losses, hits, counts, floor = 0.0, [], [], [], 0.0
    for k, (_, log_q) in enumerate(reference_drafter(draft, aux, input_ids, steps, H=4, Hkv=2,
                                                     hs=8)):
        teacher = shift_left(target_logits.float(), 1 + k)   # target's dist. of x[t+2+k]
        p = torch.softmax(teacher[..., t2d], -1)
        lm = shift_left(loss_mask.float(), k)
        position_mask = t2d[teacher.argmax(-1)].float() * lm
        loss_k = -(position_mask * (p * log_q).sum(-1)).sum() / (B * T)
        losses.append(float(loss_k))
        hits.append(float(((log_q.argmax(-1) == p.argmax(-1)).float() * position_mask).sum()))
        counts.append(float(lm.sum()))
        total += decay ** k * float(loss_k)
        floor += decay ** k * float(-(position_mask * (p * p.log()).sum(-1)).sum() / (B * T))
    return total, losses, hits, counts, floor


@pytest.fixture(scope="module")
def train_target(tmp_path_factory):
    """A random 8-layer llama, its greedy replies as examples, its 16 top reply ids."""
    root = tmp_path_factory.mktemp("train_target")
    hf = tiny_model(seed=7, vocab_size=TRAIN_VOCAB, **TRAIN_TINY)
    hf.save_pretrained(root / "target")
    target = E.load_target(str(root / "target"), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    examples = []
    for i in range(8):
        prompt = torch.randint(0, TRAIN_VOCAB, (1, 3 + i % 4), generator=g)
        tokens = prompt[0].tolist() + hf_greedy(hf, prompt, 10).tolist()
        examples.append(E.Example(tokens, [0] * prompt.shape[1] + [1] * 10))
    counts = Counter(t for ex in examples for t, m in zip(ex.tokens, ex.reply_mask) if m)
    kept = train_top_ids([counts[v] for v in range(TRAIN_VOCAB)], TRAIN_DRAFT_VOCAB)
    return SimpleNamespace(hf=hf, dir=str(root / "target"), target=target, examples=examples,
                           kept=kept)


def train_max_diff(dir_a, dir_b):
    """Largest |difference| over every tensor of two saved drafters (same keys required)."""
    a, b = (load_file(os.path.join(d, "model.safetensors")) for d in (dir_a, dir_b))
    assert sorted(a) == sorted(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


# ----------------------------------------------------------------------------------------
# vocab mapping


@pytest.mark.parametrize("counts, size, used", [
    #     id: 0  1  2  3  4  5  6  7  8  9
    # by count: 2 (5), 6 (5), then 0 and 3 tie at 3: the smaller id, 0, takes the last slot
    pytest.param([3, 0, 5, 3, 1, 0, 5, 2, 0, 0], 3, [0, 2, 6], id="smaller-id-wins-ties"),
    #     id: 0  1  2  3  4  5  6  7
    # seen: 7, 5; two more slots go to the smallest unseen ids 0, 1
    pytest.param([0, 0, 0, 0, 0, 2, 0, 7], 4, [0, 1, 5, 7], id="padded-with-unseen-ids"),
    #     id: 0  1  2  3  4  5  6  7  8  9 10 11
    # by count: 1 (9), 6 (8), 10 (6), then 3, 4, 8 tie at 4 -> 3, 4; sorted ascending
    pytest.param([1, 9, 0, 4, 4, 0, 8, 2, 4, 0, 6, 3], 5, [1, 3, 4, 6, 10], id="sorted-ascending"),
])
def test_vocab_mapping_keeps_the_most_frequent_ids_as_offsets_and_a_mask(counts, size, used):
    d2t, t2d = E.build_vocab_mapping(torch.tensor(counts), size)
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    assert d2t.tolist() == [u - i for i, u in enumerate(used)]         # target id = i + d2t[i]
    assert t2d.tolist() == [v in used for v in range(len(counts))]     # exactly the used ids


@pytest.mark.parametrize("draft_vocab_size", [0, -1, 13])
def test_vocab_mapping_refuses_draft_vocab_size_outside_1_to_V(draft_vocab_size):
    with pytest.raises(E.Eagle3Error, match=f"draft_vocab_size={draft_vocab_size}"):
        E.build_vocab_mapping(torch.ones(12, dtype=torch.long), draft_vocab_size)


# ----------------------------------------------------------------------------------------
# the training-time-test loss


def test_ttt_loss_equals_the_stepwise_reference(train_target):
    # B=2, T=7, random features/logits/loss mask, a drafter with a real 16-of-32 map: the
    # total loss, each step's loss, hits and counts
    target = train_target.target
    draft = train_randomize(tiny_draft(target, 3, train_target.kept, std=0.02), seed=4)
    g = torch.Generator().manual_seed(5)
    B, T = 2, 7
    ids = torch.randint(0, TRAIN_VOCAB, (B, T), generator=g)
    loss_mask = (torch.rand(B, T, generator=g) < 0.7).float()
    logits = torch.randn(B, T, TRAIN_VOCAB, generator=g) * 3
    aux = torch.randn(B, T, 3 * 32, generator=g)
    # the case exercises the position mask: at step 0 some loss-masked positions have their
    # full-vocab teacher argmax inside the draft vocab (kept), some outside (dropped)
    in_vocab = draft.t2d[shift_left(logits, 1).argmax(-1)]
    assert 0 < int((in_vocab & loss_mask.bool()).sum()) < int(loss_mask.sum())
    with torch.no_grad():
        result = E.ttt_loss(draft, aux, ids, loss_mask, logits, steps=7)
    total, losses, hits, counts, _ = train_reference_ttt(draft, aux, ids, loss_mask, logits,
                                                         steps=7)
    assert abs(float(result.loss) - total) <= 1e-5
    actual = [float(x) for x in result.losses]
    assert len(actual) == 7
    assert max(abs(a - b) for a, b in zip(actual, losses)) <= 1e-5, (actual, losses)
    assert [float(x) for x in result.hits] == hits
    assert [float(x) for x in result.counts] == counts


# ========================================================================================
# SPEC 6 (continued): the training loop: steps, data parallelism, resume
# ========================================================================================


def test_regenerated_replies_equal_transformers_greedy_cut_after_eos(zoo):
    """Batched, equal lengths: each reply is transformers' greedy text up to its first EOS."""
    hf, target = zoo.hf("llama"), zoo.target("llama")
    prompts = [random_prompt(seed, length).tolist()[0]
               for seed, length in [(1, 5), (2, 7), (3, 5), (4, 9), (5, 5), (6, 7)]]
    expected = [hf_greedy(hf, torch.tensor([p]), 12).tolist() for p in prompts]
    eos = Counter(t for e in expected for t in e[2:]).most_common(1)[0][0]
    cut = [e[:e.index(eos) + 1] if eos in e else e for e in expected]
    assert any(len(c) < 12 for c in cut) and any(len(c) == 12 for c in cut), cut
    assert E.regenerate_replies(target, prompts, 12, eos, batch=2) == cut


def test_a_few_optimizer_steps_reduce_the_ttt_loss(train_target, tmp_path):
    """20 AdamW steps on 8 own replies close > 1/4 of the gap to the teacher's entropy."""
    t = train_target
    draft = tiny_draft(t.target, 21, t.kept, std=0.02)
    ids, mask = train_collate(t.examples, TRAIN_PAD)
    with torch.no_grad():
        out = t.hf(ids, output_hidden_states=True)
    logits, aux = out.logits, hf_aux(out.hidden_states, TRAIN_AUX)
    before, *_, floor = train_reference_ttt(draft, aux, ids, mask, logits, steps=3)
    train_draft(t.target, draft, t.examples, [], train_config(steps=20), str(tmp_path), TRAIN_PAD)
    after, *_ = train_reference_ttt(draft, aux, ids, mask, logits, steps=3)
    assert after - floor < 0.75 * (before - floor), (floor, before, after)


def test_deepseek_drafter_training_lowers_the_ttt_loss(ds_speculation, tmp_path):
    s = ds_speculation["ds-v3"]
    example = E.Example(torch.cat([s.prompt[0], s.text]).tolist(), [0] * 8 + [1] * len(s.text))
    draft = tiny_draft(s.target, seed=5)

    def loss():
        with torch.no_grad():
            return float(ttt_batch(s.target, draft, [example], 0, steps=3).loss)
    before = loss()
    train_draft(s.target, draft, [example] * 4, [], train_config(steps=30, batch=4), tmp_path, 0)
    assert loss() < 0.8 * before, (before, loss())


def train_dp_worker(job, rank):
    """Per rank: target TP over 2, drafter trained data-parallel; rank 0 saves it."""
    target = E.load_target(job["target_dir"], dtype=torch.float32)
    draft = E.load_draft(job["draft_dir"], target)
    examples = [E.Example(t, m) for t, m in job["examples"]]
    train_draft(target, draft, examples, [], E.TrainConfig(**job["cfg"]), job["out"],
                job["pad_id"])
    return dict(world=E.world_info()[1])


def train_optimizer_max_rel_diff(file_a, file_b):
    """Largest |difference| / max |value| over the AdamW moments of two train_state.pt."""
    a, b = (torch.load(f)["optimizer"]["state"] for f in (file_a, file_b))
    assert sorted(a) == sorted(b)
    return max(float((a[i][m] - b[i][m]).abs().max() / b[i][m].abs().max())
               for i in a for m in ("exp_avg", "exp_avg_sq"))


def test_data_parallel_steps_at_world_size_2_equal_world_size_1(train_target, tmp_path):
    """2 AdamW steps split over 2 ranks equal 1 process (1 loss token a reply: under the clip)."""
    t = train_target
    examples = [E.Example(ex.tokens, [0] * (len(ex.tokens) - 1) + [1]) for ex in t.examples]
    init_dir = str(tmp_path / "init")
    E.save_draft(tiny_draft(t.target, 31, t.kept, std=0.02), init_dir)
    cfg = dict(steps=2, batch=4, lr=2e-4, warmup=1, ttt_steps=3, eval_every=1000,
               save_every=1000, seed=0)
    job = dict(target_dir=t.dir, draft_dir=init_dir, cfg=cfg, pad_id=TRAIN_PAD,
               out=str(tmp_path / "w2"), examples=[(ex.tokens, ex.reply_mask) for ex in examples])
    assert [r["world"] for r in run_workers(train_dp_worker, job, tmp_path)] == [2, 2]

    draft = E.load_draft(init_dir, t.target)
    w1, w2 = str(tmp_path / "w1"), str(tmp_path / "w2")
    train_draft(t.target, draft, examples, [], E.TrainConfig(**cfg), w1, TRAIN_PAD)
    assert train_max_diff(init_dir, w1) > 1e-4  # training moved the weights
    assert train_max_diff(w1, w2) <= 1e-5
    assert train_optimizer_max_rel_diff(os.path.join(w1, "train_state.pt"),
                                        os.path.join(w2, "train_state.pt")) <= 1e-4


def test_bf16_autocast_step_is_the_fp32_step_within_bf16_rounding(train_target):
    """A bf16-autocast step gives the fp32 step's loss and gradient to bf16 rounding, not bits."""
    t = train_target
    cfg = E.TrainConfig(steps=1, batch=8, lr=1e-3, warmup=1, ttt_steps=3)
    grads, losses = [], []
    for bf16 in (False, True):
        draft = tiny_draft(t.target, 31, t.kept, std=0.02)
        opt = E.new_optimizer(draft, cfg)
        captured = []
        opt.step = lambda: captured.append([p.grad.clone() for p in E.trainable(draft)])
        result = train_step(t.target, draft, opt, t.examples, TRAIN_PAD, 0, cfg._replace(bf16=bf16))
        assert all(p.dtype == torch.float32 for p in draft.parameters())
        grads.append(torch.cat([g.flatten() for g in captured[0]]))
        losses.append(float(result.loss.detach()))
    assert 0 < abs(losses[1] - losses[0]) <= 0.03 * abs(losses[0]), losses   # 1.4% here
    cosine = float(F.cosine_similarity(grads[0], grads[1], dim=0))
    assert 0.98 <= cosine < 1.0, cosine                                     # 0.994 here


def test_training_saves_the_last_drafter_and_its_held_out_tau(train_target, tmp_path):
    # lr 0.1 overshoots: held-out tau_sim peaks at step 2 of 8, so a keep-the-best rule would
    # save another drafter. The saved drafter (and the one left in memory) is train_state.pt's,
    # the last, scored as curve[-1] says
    t = train_target
    draft = tiny_draft(t.target, 21, t.kept, std=0.02)
    curve = train_draft(t.target, draft, t.examples[2:], t.examples[:2],
                        train_config(steps=8, eval_every=1, save_every=1, lr=0.1),
                        str(tmp_path), TRAIN_PAD)
    taus = [p["chain_tau"][-1] for p in curve]
    assert [p["step"] for p in curve] == list(range(1, 9)) and max(taus) > taus[-1], taus

    def held_out_tau(d):
        stats = E.evaluate_draft(E.live_inputs(t.target, TRAIN_PAD), d, t.examples[:2], 3)
        return round(stats.replayed_tau[-1], 4)
    saved = E.load_draft(str(tmp_path), t.target, dtype=torch.float32)
    latest = torch.load(tmp_path / E.TRAIN_STATE_FILE, weights_only=True)["draft"]
    assert all(torch.equal(v, latest[k]) for k, v in saved.state_dict().items()
               if E.owned(saved, k))
    assert torch.equal(saved.fc.weight, draft.fc.weight.detach())
    assert held_out_tau(saved) == held_out_tau(draft) == taus[-1]


# ----------------------------------------------------------------------------------------
# chat data and the train command


def test_tokenize_conversation_marks_exactly_the_assistant_tokens(train_chat_target):
    tok = train_chat_target.tok
    for messages in TRAIN_CHATS + train_conversations()[:2]:
        tokens, mask = train_render(tok, messages)
        ex = E.tokenize_conversation(tok, messages)
        assert ex.tokens == tokens
        assert ex.reply_mask == mask


@pytest.fixture(scope="module")
def train_cli_run(train_chat_target):
    c, chats = train_chat_target, train_conversations()
    proc = cli_here(*train_argv(c, chat_data(c.root / "chats.jsonl", chats), c.root / "trained",
                                "--epochs", 1, "--draft-vocab-size", 64))
    return SimpleNamespace(proc=proc, out=str(c.root / "trained"), chats=chats)


def train_argv(c, data, out, *more):
    """`train` on the chat target, batches of 2."""
    return ["train", "--target", c.dir, "--data", data, "--out", out, "--batch", 2, *more]


def test_train_cli_writes_a_drafter_over_the_64_most_frequent_reply_tokens(train_chat_target,
                                                                         train_cli_run):
    """The map is from the replies' tokens; max(1, n // 50) conversations held out."""
    c = train_chat_target
    assert train_cli_run.proc.returncode == 0, train_cli_run.proc.stderr[-3000:]
    counts = reply_token_counts(c.tok, train_cli_run.chats[1:])
    assert len(counts) > 64  # a real choice: more distinct reply tokens than draft slots
    expected = train_top_ids([counts[v] for v in range(c.vocab)], 64)
    draft = E.load_draft(train_cli_run.out, E.load_target(c.dir, dtype=torch.float32))
    assert draft.cfg.draft_vocab_size == 64 and draft.lm_head.weight.shape == (64, 32)
    assert draft.t2d.nonzero().flatten().tolist() == expected
    assert (torch.arange(64) + draft.d2t).tolist() == expected


def test_train_cli_steps_budget_and_last_point(train_chat_target, train_cli_run, tmp_path,
                                               monkeypatch):
    # --steps replaces --epochs (the schedule anneals over it), --eval-every sets the
    # evaluations; the report gives the last point
    c, seen = train_chat_target, []
    real = E.train_draft
    monkeypatch.setattr(E, "train_draft", lambda *a, **k: seen.append(a[4]) or real(*a, **k))
    report = last_json(cli_here(*train_argv(c, c.root / "chats.jsonl", tmp_path, "--steps", 3,
                                            "--eval-every", 1, "--draft-vocab-size", 64)))
    assert seen[0].steps == 3 and seen[0].eval_every == 1
    curve = json.loads((tmp_path / "curve.json").read_text())["points"]
    assert report["steps"] == 3 and [p["step"] for p in curve] == [1, 2, 3]
    assert report["last"] == curve[-1]


def test_train_init_draft_keeps_the_drafters_own_embedding_frozen(train_chat_target, tmp_path):
    # The official code and SpecForge freeze embed_tokens, the target's or the drafter's own.
    c = train_chat_target
    target = E.load_target(c.dir, dtype=torch.float32)
    counts = reply_token_counts(c.tok, train_conversations())   # frequent reply tokens
    kept = train_top_ids([counts[v] for v in range(c.vocab)], 64)
    draft = tiny_draft(target, 5, kept, own_embedding=True)
    E.save_draft(draft, str(tmp_path / "init"))
    proc = cli_here(*train_argv(c, chat_data(tmp_path / "chats.jsonl"), tmp_path / "out",
                                "--init-draft", tmp_path / "init", "--epochs", 1, "--lr", 1e-2))
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = load_file(tmp_path / "init" / "model.safetensors")
    after = load_file(tmp_path / "out" / "model.safetensors")
    assert "embed_tokens.weight" in before and sorted(before) == sorted(after)
    assert torch.equal(after["embed_tokens.weight"], before["embed_tokens.weight"])
    assert not torch.equal(after["fc.weight"], before["fc.weight"])   # training did run


# ========================================================================================
# SPEC 7. tiny models: the embedded default
# ========================================================================================


def test_tiny_demo_configs_give_a_deep_target_and_a_drafter_of_its_width_and_the_tokenizer(
        train_chat_target):
    # depth >= 8 layers (aux layers 2, L//2, L-3 distinct and apart); the drafter is one layer
    # of the target's width
    target, draft = (E.read_json(os.path.join(E.TINY_CONFIGS, f"tiny_demo_{part}.json"))
                     for part in ("target", "draft"))
    L = target["num_hidden_layers"]
    assert L >= 8 and len({2, L // 2, L - 3}) == 3
    assert draft["num_hidden_layers"] == 1 and draft["hidden_size"] == target["hidden_size"]
    # the tokenizer, trained with the `tokenizers` library on the corpus generated in code,
    # loads back with transformers' AutoTokenizer like a real model's and decodes every chat
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(train_chat_target.dir)
    assert len(tok) == len(train_chat_target.tok) < train_chat_target.vocab + 64
    for prompt, reply in E.synthetic_corpus(20, seed=99):
        text = E.chat_text(prompt, reply)
        assert tok(text).input_ids == train_chat_target.tok(text).input_ids
        assert tok.decode(tok(text).input_ids) == text
    assert [tok.convert_tokens_to_ids(t) for t in (E.USER, E.ASSISTANT, E.END)] == [
        train_chat_target.tok.convert_tokens_to_ids(t) for t in (E.USER, E.ASSISTANT, E.END)]


# ========================================================================================
# SPEC 8. bad input: a clear one-line error, nothing half-written
# ========================================================================================


# ----------------------------------------------------------------------------------------
# the target's config and weights


def config_dir(tmp_path, family="deepseek_v3", **overrides):
    """A dir holding only the config.json of a tiny target of `family` (ZOO's ds-v3 shape)."""
    ds = {**DS_TINY, **ZOO["ds-v3"][2]} if family == "deepseek_v3" else {}
    (tmp_path / "config.json").write_text(json.dumps(
        {**TINY, **ds, **overrides, "model_type": family}))
    return str(tmp_path)


def truncate_half(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def llama_copy(zoo, path, edit=lambda state: None):
    """The tiny llama checkpoint copied into `path`, its weights passed through `edit(state)`."""
    shutil.copytree(zoo.dir("llama"), path, dirs_exist_ok=True)
    return edit_draft_dir(path, state=edit)


def cut_in_half(zoo, path):
    truncate_half(llama_copy(zoo, path) / "model.safetensors")
    return path


INT4 = dict(quant_method="compressed-tensors", format="pack-quantized",
            config_groups={"group_0": {"weights": {"num_bits": 4, "group_size": 32}}})


@pytest.mark.parametrize("build, message", [  # build(zoo, tmp_path) -> the target dir
    (lambda zoo, path: config_dir(path, "gpt2"),
     r"model_type='gpt2'.*supported: llama, mistral, qwen2, qwen3"),
    (lambda zoo, path: llama_copy(zoo, path, lambda s: s.pop("model.layers.3.mlp.up_proj.weight")),
     r"missing keys \['model\.layers\.3\.mlp\.up_proj\.weight'\]"),
    (lambda zoo, path: llama_copy(
        zoo, path, lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)})),
     r"unexpected keys \['model\.layers\.0\.mlp\.extra\.weight'\]"),
    (cut_in_half, r"model\.safetensors.*corrupt"),
    (lambda zoo, path: ds_rewrite_dir(zoo.dir("kimi"), path / "int4",
                                      lambda c: dict(kimi_k2_config(c), quantization_config=INT4)),
     r"quant_method='compressed-tensors', format='pack-quantized'.*only FP8"),
], ids=["unknown-model-type", "missing-key", "unexpected-key", "corrupt-file", "int4"])
def test_bad_target_dir_is_refused_naming_the_problem(zoo, tmp_path, build, message):
    with pytest.raises(E.Eagle3Error, match=message):
        E.load_target(str(build(zoo, tmp_path)))


def test_fewer_than_7_layers_is_refused_when_aux_features_are_needed(tmp_path, zoo):
    with pytest.raises(E.Eagle3Error, match=r"num_hidden_layers >= 7"):
        E.check_aux_layers((2, 3, 3), 6)          # (2, L//2, L-3) for L = 6 collide
    six = tiny_model(num_hidden_layers=6)
    six.save_pretrained(tmp_path / "target")
    official_draft_dir(tmp_path / "draft", zoo.target("llama"))
    with pytest.raises(E.Eagle3Error, match=r"aux layers \(2, 3, 3\) for a 6-layer target"):
        E.load_draft(str(tmp_path / "draft"), E.load_target(str(tmp_path / "target")))


HEADS = r"num_attention_heads=4 and num_key_value_heads={} must both be divisible by the world"


@pytest.mark.parametrize("family, world, overrides, message", [   # world None: the config
    ("llama", 3, {}, HEADS.format(2) + " size 3"),       # neither head count divides
    ("llama", 4, {}, HEADS.format(2) + " size 4"),       # the kv heads do not
    ("deepseek_v3", 3, {}, HEADS.format(4) + " size 3"),
    ("deepseek_v3", 4, dict(num_key_value_heads=2), HEADS.format(2) + " size 4"),
    ("deepseek_v3", 2, dict(moe_intermediate_size=33),
     r"moe_intermediate_size=33 is not divisible by the world size 2"),
    ("deepseek_v3", None, dict(qk_rope_head_dim=7),
     r"qk_rope_head_dim=7 in .*config.json must be even"),
    ("deepseek_v3", None, dict(num_experts_per_tok=3, topk_group=1),
     r"cannot select num_experts_per_tok=3 experts: topk_group \* n_routed_experts / n_group = "
     r"1 \* 8 / 4 = 2"),
    ("deepseek_v3", None, dict(n_group=3), r"n_routed_experts=8, n_group=3"),
    # RoPE rotates pairs: an odd width would fail deep in the rotation (a shape error);
    # transformers' own validation catches an explicit head_dim (in one line of ours)
    ("llama", None, dict(head_dim=9),
     r"config.json is not a valid config: RoPE requires an even rotary dimension.*head_dim.*9"),
], ids=["heads", "kv-heads", "ds-heads", "ds-kv-heads", "ds-experts-width", "ds-odd-rope-dim",
        "ds-routing-cannot-select", "ds-groups-do-not-split", "odd-head-dim"])
def test_bad_configs_and_sizes_not_divisible_by_the_world_size_are_refused(
        tmp_path, family, world, overrides, message):
    with pytest.raises(E.Eagle3Error, match=message):
        cfg = E.read_target_config(config_dir(tmp_path, family, **overrides))
        if world:
            E.check_tp_sizes(cfg, world)


# ----------------------------------------------------------------------------------------
# generation inputs

GENERATORS = {  # the generation entry points must check their inputs alike
    "greedy": lambda target, draft, ids, n, eos: E.greedy_generate(target, ids, n, eos),
    "sample": lambda target, draft, ids, n, eos: E.sample_generate(target, ids, n, seed=1,
                                                                   eos_token_id=eos),
    "speculative": lambda target, draft, ids, n, eos: E.speculative_generate(
        target, draft, ids, n, tree=E.TreeShape(2, 2, 6), eos_token_id=eos),
}
IN_VOCAB = rf"the target vocab \[0, {VOCAB}\)"


def with_token(bad):
    ids = random_prompt(0)
    ids[0, 5] = bad
    return ids


@pytest.fixture(scope="module")
def plain_draft(zoo):
    return tiny_draft(zoo.target("llama"), seed=3)


@pytest.mark.parametrize("generate", list(GENERATORS))
@pytest.mark.parametrize("prompt, n, eos, message", [
    # an id outside the vocab would fail deep in the embedding (IndexError), or read another
    # row silently
    (with_token(VOCAB), 5, None, rf"token id {VOCAB}, outside {IN_VOCAB}"),
    (with_token(-1), 5, None, rf"token id -1, outside {IN_VOCAB}"),
    (random_prompt(0), 5, VOCAB + 3, rf"eos_token_id={VOCAB + 3} is not a token id of {IN_VOCAB}"),
    (random_prompt(0), 5, [1, -2], rf"eos_token_id=-2 is not a token id of {IN_VOCAB}"),
    (torch.zeros(1, 0, dtype=torch.long), 5, None, r"prompt is empty"),
    (random_prompt(0).float(), 5, None, r"must be a torch.long tensor of token ids"),
    # a 12-token prompt + 501 new tokens > max_position_embeddings = 512
    (random_prompt(0), 501, None, r"exceeds the cache length 512"),
    (random_prompt(0), 0, None, r"max_new_tokens=0 must be a positive"),
    (random_prompt(0), -3, None, r"max_new_tokens=-3 must be a positive"),
], ids=["id-over-vocab", "id-negative", "eos-over-vocab", "eos-in-a-list", "empty-prompt",
        "not-token-ids", "over-cache-length", "zero-new-tokens", "negative-new-tokens"])
def test_bad_token_ids_eos_prompt_or_budget_is_refused(zoo, plain_draft, generate, prompt, n,
                                                       eos, message):
    with pytest.raises(E.Eagle3Error, match=message):
        GENERATORS[generate](zoo.target("llama"), plain_draft, prompt, n, eos)


def test_draft_tree_refuses_unbuildable_shapes_top_k_over_its_vocab_and_ids_outside(zoo,
                                                                                   plain_draft):
    for bad in (VOCAB, -1):
        with pytest.raises(E.Eagle3Error, match=rf"token id {bad}, outside"):
            E.draft_tree(plain_draft, torch.zeros(1, 11, 3 * HIDDEN), with_token(bad), 2, 2, 6)
    # top_k=2, depth=1: a pool of 2 + 1*4 = 6 candidates, so at most 7 nodes with the root
    with pytest.raises(E.Eagle3Error, match=r"total_tokens=8 cannot be built.*= 7 nodes"):
        E.speculative_generate(zoo.target("llama"), plain_draft, random_prompt(0), 5,
                               tree=E.TreeShape(2, 1, 8))
    # a drafter with 6 draft tokens cannot offer 8 distinct children per node
    draft = tiny_draft(zoo.target("llama"), seed=4, kept=torch.tensor([0, 3, 5, 7, 9, 11]))
    with pytest.raises(E.Eagle3Error, match=r"top_k=8"):
        E.speculative_generate(zoo.target("llama"), draft, random_prompt(0), 5,
                               tree=E.TreeShape(8, 2, 10))
    with pytest.raises(E.Eagle3Error, match=r"top_k=8"):
        E.draft_tree(draft, torch.zeros(1, 4, 3 * HIDDEN), random_prompt(0, length=5), 8, 2, 10)


BAD_SAMPLING = [
    (dict(temperature=-0.5), r"temperature=-0\.5.*>= ?0"),
    (dict(top_p=0.0), r"top_p=0\.0.*\(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1\.5.*\(0, 1\]"),
    (dict(top_p=-0.2), r"top_p=-0\.2.*\(0, 1\]"),
    (dict(top_k=-1), r"top_k=-1.*>= ?0"),
    (dict(top_k=2.5), r"top_k=2\.5.*integer"),
    (dict(temperature=0.0, scheme="chain"), r"scheme='chain'.*temperature > 0"),
    (dict(scheme="beam"), r"scheme='beam'.*one of"),
]


@pytest.mark.parametrize("kwargs,match", BAD_SAMPLING, ids=lambda x: str(x)[:40])
def test_bad_sampling_settings_are_refused_by_both_samplers(kwargs, match, vocab6_target,
                                                            vocab6_drafts):
    kwargs = dict(dict(temperature=1.0), **kwargs)
    scheme = kwargs.pop("scheme", None)
    with pytest.raises(E.Eagle3Error, match=match):
        E.speculative_generate(vocab6_target, vocab6_drafts["full"], PROMPT, 4, **kwargs,
                               variant=E.resolve_variant(scheme=scheme) if scheme else None)
    if scheme is None:   # plain sampling drafts nothing
        with pytest.raises(E.Eagle3Error, match=match):
            E.sample_generate(vocab6_target, PROMPT, 4, **kwargs)


# ========================================================================================
# SPEC 8 (continued): checkpoints: truncated files are refused, interrupted writes leave whole files
# ========================================================================================


def test_truncated_train_state_or_draft_safetensors_is_refused(train_target, tmp_path):
    t, intact, broken = train_target, tmp_path / "intact", tmp_path / "broken"
    train_draft(t.target, tiny_draft(t.target, 51, t.kept, std=0.02), t.examples, [],
                train_config(steps=2, save_every=2), str(intact), TRAIN_PAD)  # a checkpoint
    shutil.copytree(intact, broken)
    E.load_draft(str(intact), t.target)  # the untouched copy loads
    truncate_half(broken / "model.safetensors")
    with pytest.raises(E.Eagle3Error, match="corrupt|truncated"):
        E.load_draft(str(broken), t.target)
    truncate_half(intact / "train_state.pt")
    with pytest.raises(E.Eagle3Error, match="truncated, corrupt or not ours"):
        train_draft(t.target, tiny_draft(t.target, 52, t.kept, std=0.02), t.examples, [],
                    train_config(steps=4), str(intact), TRAIN_PAD, resume=True)


KILLABLE = """
import os, sys, time
import eagle3_ref
# Stop at the n-th file the command renames into place, in one of three states: its temp
# file cut short (a kill while the bytes are written), complete but not yet renamed, or
# renamed. The test then sends SIGKILL.
n, state = int(os.environ["STOP_AT_WRITE"]), os.environ["STOP_STATE"]
rename, seen = os.replace, []

def replace(src, dst):
    seen.append(dst)
    if len(seen) == n:
        if state == "cut":
            with open(src, "r+b") as f:
                f.truncate(os.path.getsize(src) * int(os.environ["STOP_CUT_PERCENT"]) // 100)
        if state == "renamed":
            rename(src, dst)
        print("STOPPED", state, dst, flush=True)
        time.sleep(600)
    rename(src, dst)

os.replace = replace
eagle3_ref.main(sys.argv[1:])
"""


def run_killed(argv, cwd, write, state, cut_percent=50):
    """The CLI SIGKILLed where KILLABLE stops -> the file it was writing, or None."""
    env = cli_env(STOP_AT_WRITE=str(write), STOP_STATE=state, STOP_CUT_PERCENT=str(cut_percent))
    proc = subprocess.Popen([sys.executable, "-c", KILLABLE, *map(str, argv)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in proc.stdout:
        if line.startswith("STOPPED"):
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=60)
            return line.split()[2]
    assert proc.wait(timeout=240) == 0, "the command failed before it was stopped"
    return None


def test_training_killed_while_writing_checkpoints_resumes_to_the_same_weights(
        train_chat_target, train_cli_run, tmp_path):
    # 17 training conversations, batch 2: 8 steps, each saving model.safetensors,
    # config.json, train_state.pt and curve.json (4 renames per step, counted from each
    # process's start). Six kills, each resumed, each in another file and state, the run
    # moving on between them; train_state.pt under its name always holds the last step whose
    # save completed, and the curve it carries is whole.
    c, rng = train_chat_target, random.Random(15)
    assert train_cli_run.proc.returncode == 0, train_cli_run.proc.stderr[-3000:]
    out = tmp_path / "run"
    argv = train_argv(c, c.root / "chats.jsonl", out, "--epochs", 1, "--draft-vocab-size", 64)
    target, kills = E.load_target(c.dir, dtype=torch.float32), []
    for write, state, name, step in ((7, "cut", "train_state.pt", 1),      # in step 2
                                     (5, "whole", "model.safetensors", 2),  # in step 3
                                     (2, "renamed", "config.json", 2),      # in step 3
                                     (7, "renamed", "train_state.pt", 4),   # in step 4
                                     (8, "cut", "curve.json", 6),           # in step 6
                                     (5, "cut", "model.safetensors", 7)):   # in step 8
        stopped = run_killed(argv + ["--resume"] * bool(kills), tmp_path, write, state,
                             rng.randint(1, 99))
        assert stopped == str(out / name), (stopped, name)
        kills.append((write, state, name))
        assert torch.load(out / "train_state.pt", weights_only=True)["step"] == step, kills
        E.load_draft(str(out), target)               # the drafter under its names is whole
    at_step_7 = torch.load(out / "train_state.pt", weights_only=True)["draft"]
    proc = cli_here(*argv, "--resume")                 # the last resume runs to the end
    assert proc.returncode in (0, None), (kills, proc.stderr[-3000:])
    straight, resumed = (load_file(os.path.join(d, "model.safetensors"))
                         for d in (train_cli_run.out, out))
    assert sorted(straight) == sorted(resumed)
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), (name, kills)
    final = torch.load(out / "train_state.pt", weights_only=True)
    assert any(not torch.equal(final["draft"][k], v) for k, v in at_step_7.items())  # step 8 ran
    assert final["step"] == 8 and [p["step"] for p in final["curve"]] == list(range(1, 9))
    assert json.loads((out / "curve.json").read_text())["points"] == final["curve"]
    straight_curve = E.read_json(os.path.join(train_cli_run.out, "curve.json"))["points"]
    assert ([dict(p, train_seconds=0) for p in final["curve"]] ==     # the same drafter at
            [dict(p, train_seconds=0) for p in straight_curve])      # every evaluation


def test_golden_write_killed_midway_leaves_no_file_that_check_accepts(golden_models, tmp_path):
    trace = str(tmp_path / "trace.safetensors")
    for state in ("cut", "whole"):   # killed before the rename: nothing under the name
        stopped = run_killed(golden_args(golden_models, trace, "greedy"), tmp_path, 1, state)
        assert stopped == trace and not os.path.exists(trace)
        leftovers = [f for f in os.listdir(tmp_path) if f.startswith("trace.safetensors.tmp")]
        assert leftovers, os.listdir(tmp_path)
        for name in leftovers:       # a cut-short temp file is refused, not half-checked
            if state == "cut":
                line = refused(cli_here("golden", "--check", str(tmp_path / name)))
                assert "is not a golden trace" in line, line
            os.remove(tmp_path / name)
        line = refused(cli_here("golden", "--check", trace))
        assert "does not exist" in line
    # a complete trace, then a rewrite killed mid-way: the complete one is still there
    proc = cli_here(*golden_args(golden_models, trace, "sampled"))
    assert proc.returncode in (0, None), proc.stderr[-3000:]
    before = open(trace, "rb").read()
    run_killed(golden_args(golden_models, trace, "greedy"), tmp_path, 1, "cut", 70)
    assert open(trace, "rb").read() == before
    check = cli_here("golden", "--check", trace)
    assert check.returncode == 0 and check.stdout.strip().endswith("match"), check.stderr


def test_atomic_write_replaces_a_killed_writes_temp_file_and_gives_the_umask_mode(tmp_path):
    path = tmp_path / "train_state.pt"
    (tmp_path / "train_state.pt.tmp").write_bytes(b"cut sh")  # what a SIGKILL mid-write leaves
    E.atomic_write(str(path), lambda f: torch.save({"step": 3}, f))
    assert torch.load(path) == {"step": 3}
    assert sorted(os.listdir(tmp_path)) == ["train_state.pt"]
    old = os.umask(0o027)
    try:            # not safetensors' 0600: what open() would give
        path = tmp_path / "model.safetensors"
        E.atomic_write(str(path), lambda f: save_file({"w": torch.ones(2)}, f))
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------------------
# wrong input through the CLI: one `error:` line naming the value, exit code 2, no traceback


@pytest.mark.parametrize("command,dest", cli_path_flags(REF_CLI), ids=lambda x: x)
def test_every_path_flag_refuses_missing_wrong_kind_and_unreadable_paths(command, dest, tmp_path,
                                                                         monkeypatch):
    # checked before anything loads: a typo costs one line, not minutes of loading, and a
    # missing local dir is never handed to the hub as a repo id
    check_path_flag(REF_CLI, command, dest, tmp_path, monkeypatch)


BAD_INPUTS = {  # name -> (argv from the bad_inputs fixture, what the one line must say)
    "target config.json is not JSON": (lambda b: [
        "generate", "--target", b.broken_target, "--draft", b.draft, "--prompt", "hi"],
        r"config.json' is not valid JSON \(.* at line 2 column 1\)"),
    "drafter config.json is not JSON": (lambda b: [
        "generate", "--target", b.target, "--draft", b.broken_draft, "--prompt", "hi"],
        r"draft/config.json' is not valid JSON \(Expecting property name .* column 2\)"),
    "drafter config transformers rejects": (lambda b: [
        "generate", "--target", b.target, "--draft", b.draft_heads, "--prompt", "hi"],
        r"draft_heads/config.json is not a valid config: The hidden size \(32\) is not a "
        r"multiple of the number of attention heads \(5\)"),
    "a model dir without a tokenizer": (lambda b: [
        "generate", "--target", b.no_tokenizer, "--draft", b.draft, "--prompt", "hi"],
        r"no tokenizer in '.*no_tokenizer' \(none of tokenizer.json"),
    "an empty prompt": (lambda b: [
        "generate", "--target", b.target, "--draft", b.draft, "--prompt", ""],
        r"the prompt is empty \(input_ids of shape \(1, 0\)\); give at least one token"),
    "a negative temperature": (lambda b: [
        "generate", "--target", b.target, "--draft", b.draft, "--prompt", "hi",
        "--max-new-tokens", "4", "--temperature", "-1"], r"temperature=-1\.0"),
    "chain at temperature 0": (lambda b: [
        "generate", "--target", b.target, "--draft", b.draft, "--prompt", "hi", "--scheme",
        "chain"], r"scheme='chain' samples its drafts and needs temperature > 0"),
    "an option argparse rejects": (lambda b: [
        "generate", "--prompt", "hi", "--max-new-tokens", "ten"],
        r"argument --max-new-tokens: invalid int value: 'ten'"),
    "a data line is not JSON": (lambda b: [
        "train", "--target", b.target, "--data", b.broken_chats, "--out", b.root / "o1"],
        r"broken.jsonl:3 is not valid JSON"),
    "a data line whose turns are not chat turns": (lambda b: [
        "train", "--target", b.target, "--data", b.turnless, "--out", b.root / "o4"],
        r"turnless.jsonl:5: turn 'hi' is not \{role, content\} or \{from, value\}"),
    "--data does not exist": (lambda b: [
        "train", "--target", b.target, "--data", b.root / "nope.jsonl", "--out", b.root / "o2"],
        r"--data '.*nope.jsonl' does not exist; expected a local file"),
    "a count that is not positive": (lambda b: [
        "train", "--target", b.target, "--data", b.chats, "--out", b.root / "o3", "--batch",
        "0"], r"--batch 0 must be > 0"),
    "--prompt-ids are not integers": (lambda b: [
        "golden", "--target", b.target, "--draft", b.draft, "--prompt-ids", "3,4;5,x1",
        "--out", b.root / "g.safetensors"], r"--prompt-ids '5,x1': 'x1' is not an int"),
    "--prompt-ids outside the vocab": (lambda b: [
        "golden", "--target", b.target, "--draft", b.draft, "--prompt-ids", f"3,{b.vocab},4",
        "--out", b.root / "g.safetensors"], r"token id (\d+), outside the target vocab \[0, \1\)"),
    "EOS outside the vocab": (lambda b: [
        "golden", "--target", b.target, "--draft", b.draft, "--prompt-ids", "3,4",
        "--eos-token-id", "100000", "--out", b.root / "g.safetensors"],
        r"eos_token_id=100000 is not a token id of the target vocab"),
    "golden --check on a drafter's weights": (lambda b: [
        "golden", "--check", os.path.join(b.draft, "model.safetensors")],
        r"model.safetensors' is not a golden trace of format 'eagle3-ref-golden'"),
    "golden --check on a text file": (lambda b: ["golden", "--check", b.chats],
                                      r"chats.jsonl' is not a golden trace \("),
}
AS_A_USER = ("target config.json is not JSON", "a negative temperature")  # in a real process


@pytest.mark.parametrize("name", BAD_INPUTS)
def test_bad_input_is_one_error_line_naming_the_value_with_exit_code_2(bad_inputs, name):
    check_bad_input(bad_inputs, *BAD_INPUTS[name], as_a_user=name in AS_A_USER)


# ========================================================================================
# the reference's command line: golden traces (write, replay, --check)
# ========================================================================================

GOLDEN_VOCAB = 24        # small vocab: varied greedy text, drafts accepted several levels deep
GOLDEN_PROMPT = [3, 1, 4, 1, 5]
GOLDEN_NEW_TOKENS = 24
GOLDEN_TREE = [3, 2, 8]  # tree top_k, depth, total_tokens
GOLDEN_KEPT = [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13, 15, 16, 18, 20, 21, 23]  # draft vocab
GOLDEN_RUNS = {          # trace kind -> the sampling flags of `golden`
    "greedy": [],
    "sampled": ["--temperature", "0.8", "--top-p", "0.9", "--seed", "7"],
    "chain": ["--scheme", "chain", "--temperature", "0.8", "--top-p", "0.9", "--seed", "7"],
}
GOLDEN_ATOL = 1e-4       # fp32 round-off between world size 1 and 2 (all-reduce order)


def golden_read(path):
    """(header dict, {name: tensor}) read with safetensors itself."""
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["eagle3_golden"]), {k: f.get_tensor(k) for k in f.keys()}


def golden_round(tensors, r, field):
    return tensors[f"round{r:04d}.{field}"]


def golden_warped(logits):
    return hf_warped_probs(logits[None], E.Sampling(temperature=0.8, top_p=0.9))[0]


@pytest.fixture(scope="module")
def golden_models(tmp_path_factory):
    """A random 8-layer target, a drafter over 18 of its 24 ids sharpened on its greedy text."""
    def build(root):
        hf = tiny_model(seed=0, vocab_size=GOLDEN_VOCAB, max_position_embeddings=256)
        hf.save_pretrained(root / "target")
        target = E.load_target(str(root / "target"))
        draft = tiny_draft(target, 3, GOLDEN_KEPT)
        text = torch.cat([torch.tensor(GOLDEN_PROMPT), hf_greedy(hf, GOLDEN_PROMPT, 40)])
        sharpen(draft, target, text[None], steps=40)
        E.save_draft(draft, str(root / "draft"))
        return dict(target=str(root / "target"), draft=str(root / "draft"))
    models = built_once(tmp_path_factory, "golden_models", build)
    return dict(models, hf=transformers.AutoModelForCausalLM.from_pretrained(models["target"]))


def golden_args(models, out, kind):
    return (["golden", "--out", out, "--target", models["target"], "--draft", models["draft"],
             "--prompt-ids", ",".join(map(str, GOLDEN_PROMPT)),
             "--max-new-tokens", GOLDEN_NEW_TOKENS, "--tree-top-k", GOLDEN_TREE[0],
             "--depth", GOLDEN_TREE[1], "--total-tokens", GOLDEN_TREE[2]] + GOLDEN_RUNS[kind])


@pytest.fixture(scope="module")
def golden_traces(golden_models, tmp_path_factory):
    """{kind: {w1a (a process) | w1b (here) | w2: dict(file, header, tensors, proc)}}"""
    def build(root):
        runs = {(kind, run): str(root / f"{kind}-{run}.safetensors")
                for kind in GOLDEN_RUNS for run in ("w1a", "w1b", "w2")}
        procs = {key: cli(*golden_args(golden_models, runs[key], key[0]))
                 for key in runs if key[1] == "w1a"}
        finished = {key: cli_here(*golden_args(golden_models, runs[key], key[0]))
                    for key in runs if key[1] == "w1b"}
        finished.update(zip(procs, finish(*procs.values())))
        for kind in GOLDEN_RUNS:                        # each torchrun launch takes both cores
            key = (kind, "w2")
            finished[key] = finish(cli(*golden_args(golden_models, runs[key], kind),
                                       world=2))[0]
        return {key: (file, finished[key]) for key, file in runs.items()}
    traces = {kind: {} for kind in GOLDEN_RUNS}
    built = built_once(tmp_path_factory, "golden_traces", build)
    for (kind, run), (file, proc) in built.items():  # a missing file fails only its readers
        header, tensors = golden_read(file) if os.path.isfile(file) else (None, None)
        traces[kind][run] = dict(file=file, header=header, tensors=tensors, proc=proc)
    return traces


def golden_trace(traces, kind, run="w1a"):
    """One written trace: dict(file, header, tensors, proc)."""
    trace = traces[kind][run]
    proc = trace["proc"]
    assert trace["tensors"] is not None, \
        f"{kind} {run} wrote no trace (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return trace


# ----------------------------------------------------------------------------------------
# a golden trace is reproducible


@pytest.mark.parametrize("kind", list(GOLDEN_RUNS))
def test_golden_trace_is_bit_identical_across_runs_equal_at_w2_and_its_header_says_so(
        golden_traces, golden_models, kind):
    """A rerun: bit for bit; at W = 2 logits to fp32 round-off (all-reduce order); the header."""
    a, flags = golden_trace(golden_traces, kind, "w1a"), GOLDEN_RUNS[kind]
    sampling = dict(zip(flags[::2], flags[1::2]))
    for run in ("w1b", "w2"):
        b = golden_trace(golden_traces, kind, run)
        for proc in (a["proc"], b["proc"]):
            assert proc.returncode == 0, f"{kind}: exit {proc.returncode}:\n{proc.stderr[-3000:]}"
        assert run == "w2" or a["header"] == b["header"]
        assert sorted(a["tensors"]) == sorted(b["tensors"])
        for name, x in a["tensors"].items():
            y = b["tensors"][name]
            assert x.dtype == y.dtype and x.shape == y.shape, (name, run)
            if run == "w2" and name.endswith((".logits", ".draft_probs")):
                diff = float((x - y).abs().max())
                assert diff <= GOLDEN_ATOL, f"{name}: max abs diff {diff:.3g} between W=1 and W=2"
            else:
                assert torch.equal(x, y), f"{name} differs between {run} and a first run"
    config = dict(target=os.path.abspath(golden_models["target"]), input_ids=GOLDEN_PROMPT,
                  draft=os.path.abspath(golden_models["draft"]), tree=GOLDEN_TREE,
                  max_new_tokens=GOLDEN_NEW_TOKENS, top_k=0, eos_token_id=None, dtype="float32",
                  temperature=float(sampling.get("--temperature", 0.0)),
                  top_p=float(sampling.get("--top-p", 1.0)), seed=int(sampling.get("--seed", 0)),
                  scheme=sampling.get("--scheme", "tree"))
    for run, world in (("w1a", 1), ("w2", 2)):
        h = golden_trace(golden_traces, kind, run)["header"]
        assert (h["format"], h["version"], h["world_size"]) == ("eagle3-ref-golden", 1, world)
        assert (h["torch"], h["transformers"]) == (torch.__version__, transformers.__version__)
        assert {key: h["config"][key] for key in config} == config


# ========================================================================================
# golden traces (continued): a golden trace is what it claims to be
# ========================================================================================


@pytest.mark.parametrize("kind", list(GOLDEN_RUNS))
def test_golden_rounds_concatenate_to_the_output_tree_fields_follow_parents_logits_are_hfs(
        golden_traces, golden_models, kind):
    # Each round's root is the last token so far; its path and bonus the next tokens, then
    # cut. positions, mask and retrieve_indices rebuilt by walking parents; the accepted
    # path is a root-first chain of parent links. Node i of round r is scored (transformers)
    # after prompt + output before the root + its ancestors.
    t = golden_trace(golden_traces, kind)["tensors"]
    nodes = GOLDEN_TREE[2] if kind != "chain" else GOLDEN_TREE[1] + 2  # root + depth+1 drafts
    out = t["tokens"][:1].tolist()  # the prefill's token is round 0's root
    for r in range(len(t["accept_lengths"])):
        assert len(out) < GOLDEN_NEW_TOKENS, f"round {r} runs after the output was complete"
        tokens, path = golden_round(t, r, "tree_tokens"), golden_round(t, r, "path").tolist()
        assert int(tokens[0]) == out[-1], f"round {r} root"
        chains = tree_paths(SimpleNamespace(**{field: golden_round(t, r, field) for field in (
            "parents", "positions", "mask", "retrieve_indices")}), f"round {r}")
        assert len(chains) == nodes
        assert path == chains[path[-1]], f"round {r}: path {path} is not a root-first chain"
        length = int(t["accept_lengths"][r])       # accepted nodes + the bonus = the path
        assert golden_round(t, r, "accept_length").tolist() == [len(path)] == [length]
        prefix = GOLDEN_PROMPT + t["tokens"][:len(out) - 1].tolist()   # before the root
        logits = golden_round(t, r, "logits")
        assert logits.shape == (nodes, GOLDEN_VOCAB) and logits.dtype == torch.float32
        for i, chain in enumerate(chains):
            with torch.no_grad():
                hf_out = golden_models["hf"](torch.tensor([prefix + tokens[chain].tolist()]))
            diff = float((logits[i] - hf_out.logits[0, -1]).abs().max())
            assert diff <= GOLDEN_ATOL, f"round {r} node {i}: max abs diff {diff:.3g}"
        out += tokens[path[1:]].tolist() + golden_round(t, r, "bonus").tolist()
    assert len(t["tokens"]) == GOLDEN_NEW_TOKENS
    assert out[:GOLDEN_NEW_TOKENS] == t["tokens"].tolist()


def test_golden_greedy_trace_is_transformers_text_the_longest_argmax_match_and_no_uniforms(
        golden_traces, golden_models):
    t = golden_trace(golden_traces, "greedy")["tensors"]
    expected = hf_greedy(golden_models["hf"], GOLDEN_PROMPT, GOLDEN_NEW_TOKENS)
    assert t["input_ids"].tolist() == GOLDEN_PROMPT
    assert t["tokens"].tolist() == expected.tolist()
    names = ["first_uniforms"] + [f"round{r:04d}.uniforms" for r in range(len(t["accept_lengths"]))]
    assert all(t[n].shape == (0,) and t[n].dtype == torch.float64 for n in names)
    depths = []         # each path the longest argmax match, the bonus the argmax
    for r in range(len(t["accept_lengths"])):
        tokens, parents = golden_round(t, r, "tree_tokens"), golden_round(t, r, "parents")
        argmax = golden_round(t, r, "logits").argmax(-1)
        path = golden_round(t, r, "path").tolist()
        for node, child in zip(path, path[1:]):
            assert int(tokens[child]) == int(argmax[node]), f"round {r}: node {child} accepted"
        last = path[-1]
        assert all(int(tokens[c]) != int(argmax[last]) for c in children(parents, last)), \
            f"round {r}: a child of node {last} matches the argmax but was not accepted"
        assert golden_round(t, r, "bonus").tolist() == [int(argmax[last])]
        depths.append(len(path) - 1)
    assert max(depths) >= 2, f"accepted depths {depths}: the trace never goes below level 1"


@pytest.mark.parametrize("kind", ["sampled", "chain"])
def test_golden_sampled_uniforms_are_the_seeded_stream_and_acceptance_replays_from_them(
        golden_traces, golden_models, kind):
    # first_uniforms, then each round's: one seeded generator (seed 7), one float64 draw at
    # a time. Replayed with transformers' warpers: a tree tries children in node order,
    # accepts x iff u < p(x), else zeroes p(x) and renormalises; a chain's drafts are q's
    # inverse CDF, each accepted iff u * q(x) < p(x), else the bonus is drawn from
    # norm(max(0, p - q)); the bonus by inverse CDF. A round uses up its uniforms: one per
    # tried sibling (or per draft and decision), one for the bonus.
    t = golden_trace(golden_traces, kind)["tensors"]
    rounds = range(len(t["accept_lengths"]))
    used = torch.cat([t["first_uniforms"]] + [golden_round(t, r, "uniforms") for r in rounds])
    assert used.tolist() == list(itertools.islice(coins(7), len(used)))
    assert len(t["first_uniforms"]) == 1
    with torch.no_grad():
        prefill = golden_models["hf"](torch.tensor([GOLDEN_PROMPT])).logits[0, -1]
    assert int(t["tokens"][0]) == inverse_cdf(golden_warped(prefill), float(used[0]))
    outside, k = sorted(set(range(GOLDEN_VOCAB)) - set(GOLDEN_KEPT)), GOLDEN_TREE[1] + 1
    rejected = 0
    for r in rounds:
        tokens, logits = golden_round(t, r, "tree_tokens"), golden_round(t, r, "logits")
        parents, uniforms = golden_round(t, r, "parents").tolist(), golden_round(t, r, "uniforms")
        u = iter(uniforms.tolist())
        if kind == "sampled":
            node, path, p = 0, [0], golden_warped(logits[0])
            while True:
                for child in children(parents, node):
                    x = int(tokens[child])
                    if next(u) < p[x]:
                        node, p = child, golden_warped(logits[child])
                        path.append(node)
                        break
                    rejected += 1
                    p[x] = 0
                    p = p / p.sum()
                else:
                    break
        else:
            q = golden_round(t, r, "draft_probs")
            assert q.shape == (k, GOLDEN_VOCAB) and q.dtype == torch.float64
            assert torch.allclose(q.sum(-1), torch.ones(k, dtype=q.dtype)), f"round {r}: q rows"
            assert not q[:, outside].any(), f"round {r}: q outside the draft vocab"
            drafts = [inverse_cdf(q[i], next(u)) for i in range(k)]
            assert tokens[1:].tolist() == drafts, f"round {r}: drafts are not q's inverse CDF"
            for i, x in enumerate(drafts):
                p = golden_warped(logits[i])
                if next(u) * q[i, x] < p[x]:
                    continue
                rejected += 1
                path, p = list(range(i + 1)), (p - q[i]).clamp(min=0)
                break
            else:
                path, p = list(range(k + 1)), golden_warped(logits[k])
        assert golden_round(t, r, "path").tolist() == path, f"round {r}"
        assert golden_round(t, r, "bonus").tolist() == [inverse_cdf(p, next(u))]
        assert next(u, None) is None, f"round {r} recorded unused uniforms"
    assert rejected > 0 and max(t["accept_lengths"].tolist()) >= 2  # both branches replayed


# ----------------------------------------------------------------------------------------
# golden --check, and batches in the engines' layouts


def golden_write(path, header, tensors):
    save_file(tensors, str(path), metadata={"eagle3_golden": json.dumps(header)})


def golden_flip(file, name, index, out):
    """A copy of a golden trace, one token of tensor `name` changed -> (old token, new)."""
    header, tensors = golden_read(file)
    flipped = dict(tensors, **{name: tensors[name].clone()})
    old = int(flipped[name][index])
    flipped[name][index] = (old + 1) % GOLDEN_VOCAB
    golden_write(out, header, flipped)
    return old, int(flipped[name][index])


@pytest.fixture(scope="module")
def golden_checks(golden_traces, tmp_path_factory):
    """`golden --check` on both traces, a flipped tree token, a version-2 header."""
    root = tmp_path_factory.mktemp("golden_checks")
    file = golden_trace(golden_traces, "greedy")["file"]
    old, new = golden_flip(file, "round0002.tree_tokens", 3, root / "flipped.safetensors")
    header, tensors = golden_read(file)
    golden_write(root / "version2.safetensors", dict(header, version=2), tensors)
    files = {kind: golden_trace(golden_traces, kind)["file"] for kind in GOLDEN_RUNS}
    files.update(flipped=str(root / "flipped.safetensors"),
                 version2=str(root / "version2.safetensors"))
    return dict({k: cli_here("golden", "--check", f) for k, f in files.items()}, old=old, new=new)


def test_golden_check_matches_untouched_traces_names_a_flipped_token_and_refuses_version_2(
        golden_checks):
    for kind in GOLDEN_RUNS:
        proc = golden_checks[kind]
        assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
        assert proc.stdout.strip().splitlines() == ["match"]
    proc, old, new = golden_checks["flipped"], golden_checks["old"], golden_checks["new"]
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("first divergence:"), lines
    assert re.search(r"\bround 2\b", lines[0]) and "tree_tokens" in lines[0], lines[0]
    assert re.search(r"\bindex 3\b", lines[0]), lines[0]
    assert f"file {new}, re-run {old}" in lines[0], lines[0]
    proc = golden_checks["version2"]
    assert proc.returncode == 2, proc.stdout + proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    assert re.search(r"version\W{0,3}2\b", lines[0]), lines[0]
    assert "match" not in proc.stdout


BATCH_GOLDEN_PROMPTS = "3,1,4;1,5,9,2,6;5,3"


@pytest.fixture(scope="module")
def batch_golden(golden_models, tmp_path_factory):
    """3 prompts per preset, sampled, written twice; SGLang's rechecked after a flip."""
    def build(root):
        runs = {}
        for preset in ("sglang", "vllm"):
            args = ["golden", "--target", golden_models["target"], "--draft",
                    golden_models["draft"], "--prompt-ids", BATCH_GOLDEN_PROMPTS,
                    "--max-new-tokens", 16, "--tree-top-k", 3, "--depth", 2, "--total-tokens", 8,
                    "--preset", preset, "--temperature", 0.8, "--seed", 7]
            files = [str(root / f"batch-{preset}-{i}.safetensors") for i in range(2)]
            started = cli(*args, "--out", files[0])        # one run in a process of its own,
            procs = [cli_here(*args, "--out", files[1])]    # one in this process meanwhile
            runs[preset] = list(zip(files, finish(started) + procs))
        file = runs["sglang"][0][0]
        old, new = golden_flip(file, "row01.round0001.tree_tokens", 2,
                               root / "batch-flipped.safetensors")
        check = [cli_here("golden", "--check", f)
                 for f in (root / "batch-flipped.safetensors", file)]
        return SimpleNamespace(runs=runs, check=check, old=old, new=new)
    built = built_once(tmp_path_factory, "batch_golden", build)
    runs = {preset: [(f, p, golden_read(f) if os.path.isfile(f) else None) for f, p in pairs]
            for preset, pairs in built.runs.items()}
    return SimpleNamespace(**dict(vars(built), runs=runs))


@pytest.mark.parametrize("preset", ["sglang", "vllm"])
def test_batch_golden_trace_is_bit_identical_across_two_runs(batch_golden, preset):
    (_, pa, a), (_, pb, b) = batch_golden.runs[preset]
    assert a is not None and b is not None, pa.stderr[-2000:] + pb.stderr[-2000:]
    (ha, ta), (hb, tb) = a, b
    assert ha == hb and sorted(ta) == sorted(tb)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    assert ha["config"]["prompts"] == [[3, 1, 4], [1, 5, 9, 2, 6], [5, 3]]
    assert ha["config"]["preset"] == E.preset_record(E.PRESETS[preset])
    rows = {k.split(".")[0] for k in ta}
    assert rows == {"row00", "row01", "row02"}


def test_batch_golden_records_each_engines_random_numbers_and_check_names_a_flipped_token(
        batch_golden):
    (_, _, (_, sg)), (_, _, (_, vl)) = batch_golden.runs["sglang"][0], batch_golden.runs["vllm"][0]
    nodes = sg["row00.round0000.tree_tokens"].shape[0]
    assert sg["row00.round0000.coins"].shape == (nodes,) and sg["row00.round0000.coins"].dtype == \
        torch.float32
    assert sg["row00.round0000.final_coin"].shape == (1,)
    assert sg["row00.round0000.sglang.retrive_next_token"].shape == (nodes,)
    drafts = vl["row00.round0000.tree_tokens"].shape[0] - 1      # a chain of argmax drafts
    assert vl["row00.round0000.parents"].tolist() == list(range(-1, drafts))
    assert vl["row00.round0000.draft_uniforms"].shape == (drafts,)
    assert vl["row00.round0000.draft_uniforms"].dtype == torch.float64
    assert vl["row00.round0000.exponentials"].shape == (GOLDEN_VOCAB,)
    # the generator state before a round's draws regenerates them exactly
    g = torch.Generator()
    g.set_state(vl["row01.round0002.generator_state"])
    assert torch.equal(torch.empty(GOLDEN_VOCAB).exponential_(generator=g),
                       vl["row01.round0002.bonus_exponentials"])
    # --check names the row, round, field and index of a flipped token
    flipped, untouched = batch_golden.check
    assert untouched.returncode == 0 and untouched.stdout.strip() == "match", untouched.stderr
    assert flipped.returncode == 1, flipped.stdout + flipped.stderr[-2000:]
    line = flipped.stdout.strip()
    assert line.startswith("first divergence: row 1, round 1, field tree_tokens, index 2:"), line
    assert f"file {batch_golden.new}, re-run {batch_golden.old}" in line, line


# ========================================================================================
# the reference's command line: the generate command
# ========================================================================================


def generate_chat(c, setup, *more):
    """`generate` of TRAIN_GEN_PROMPT, chat-templated: 12 tokens, trees of 6 nodes."""
    return ["generate", "--target", c.dir, "--draft", setup.draft_dir, "--prompt",
            TRAIN_GEN_PROMPT, "--chat", "--max-new-tokens", 12, "--tree-top-k", 2, "--depth", 2,
            "--total-tokens", 6, *more]


def test_show_tree_draws_the_tree_and_marks_the_accepted_path_by_hand():
    # root 7 with children 8 (child 10) and 9; accepted path 7 -> 8 -> 10
    tree = E.tree_from_parents(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))
    names = SimpleNamespace(decode=lambda ids: f"t{ids[0]}")
    assert E.render_tree(tree, torch.tensor([0, 1, 3]), names).splitlines() == [
        "*'t7'", "├─ *'t8'", "│  └─ *'t10'", "└─  't9'"]


def test_generate_cli_prints_the_greedy_text_and_tau(train_chat_target, train_generate_setup):
    c = train_chat_target
    proc = cli_here(*generate_chat(c, train_generate_setup))
    assert proc.returncode == 0, proc.stderr[-3000:]
    new = hf_greedy(c.hf, train_chat_prompt_ids(c.tok, TRAIN_GEN_PROMPT), 12,
                    c.tok.eos_token_id).tolist()
    text = c.tok.decode(new)
    assert proc.stdout.startswith(text + "\n"), (proc.stdout, text)
    tau_line = proc.stdout[len(text) + 1:]
    match = re.fullmatch(r"tau (\d+\.\d\d) \| rounds (\d+) \| tokens (\d+) \| [\d.]+ tokens/s\n",
                         tau_line)
    assert match, tau_line
    # drafts were accepted (tau > 1), at most depth + 2 = 4 tokens per round
    assert 1.0 < float(match[1]) <= 4.0 and int(match[3]) == len(new) == 12


CUSTOM_TOKENIZER = """from transformers import PreTrainedTokenizerFast


class TinyCustomTokenizer(PreTrainedTokenizerFast):
    pass
"""


def test_tokenizer_with_its_own_code_needs_trust_remote_code(
        train_chat_target, train_generate_setup, tmp_path, monkeypatch):
    # Kimi's tokenizer ships its own code: without the flag a one-line error says so; with
    # it the command runs (and golden encodes the prompt through that tokenizer)
    target = tmp_path / "target"
    shutil.copytree(train_chat_target.dir, target)
    config = E.read_json(target / "tokenizer_config.json")
    (target / "tokenizer_config.json").write_text(json.dumps(dict(
        config, tokenizer_class="TinyCustomTokenizer",
        auto_map={"AutoTokenizer": [None, "tokenization_tiny.TinyCustomTokenizer"]})))
    (target / "tokenization_tiny.py").write_text(CUSTOM_TOKENIZER)
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "modules"))  # where it is copied
    args = ["golden", "--out", str(tmp_path / "trace.safetensors"), "--target", str(target),
            "--draft", train_generate_setup.draft_dir, "--prompt", TRAIN_GEN_PROMPT,
            "--max-new-tokens", "4"]
    refused = run_cli(*args, cwd=tmp_path)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert re.search(r"^error: the tokenizer in .* ships its own code; rerun with "
                     r"--trust-remote-code", refused.stderr, re.M)
    trusted = run_cli(*args + ["--trust-remote-code"], cwd=tmp_path)
    assert trusted.returncode == 0, trusted.stderr[-3000:]
    header, _ = golden_read(tmp_path / "trace.safetensors")
    assert header["config"]["input_ids"] == train_chat_prompt_ids(train_chat_target.tok,
                                                                  TRAIN_GEN_PROMPT)


# ========================================================================================
# the losslessness fuzzer: random targets, drafters, trees and prompts (-m fuzz --fuzz-cases N)
# ========================================================================================


# ----------------------------------------------------------------------------------------
# the fuzzer's random cases

FUZZ_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "deepseek_v3")
FUZZ_ROPE = (None, "linear", "dynamic", "llama3", "yarn")
FUZZ_PRESETS = ("official", "sglang", "vllm")
FUZZ_W2_EVERY = 10   # case seeds 9, 19, 29, ... also run at world size 2 (one torchrun launch)
NEAR_TIE = 1e-4      # fp32 top-2 logit gap below which two implementations may pick apart
COIN_TIE = 1e-6      # |u - p(x)| (or a uniform this close to a CDF edge) for a sampled decision


class NearTie(UserWarning):
    """A divergence at a near-tie: reported, not failed (the issue of floating point)."""


class FuzzCase(NamedTuple):
    seed: int
    family: str
    config: dict          # the transformers config fields of the target
    draft: dict           # the drafter's config.json fields
    kept: list            # draft vocab (ascending target ids); None: the whole vocab, no map
    sharpen: bool         # a few TTT steps on the target's greedy text (deeper acceptance)
    shape: tuple          # (tree top-k, depth, total tokens) of both runs
    prompt: list
    eos: int              # or None
    max_new_tokens: int
    preset: str           # of the greedy run
    temperature: float    # the sampled run (official preset): tree or chain
    top_p: float
    top_k: int
    scheme: str
    world: int

    def describe(self):
        return (f"seed {self.seed}: {self.family} L={self.config['num_hidden_layers']} "
                f"D={self.config['hidden_size']} V={self.config['vocab_size']} "
                f"heads {self.config['num_attention_heads']}/{self.config['num_key_value_heads']}"
                f" rope={fuzz_rope_name(self.config)} tied={self.config['tie_word_embeddings']} "
                f"draft vocab {len(self.kept) if self.kept else 'full'} tree {self.shape} "
                f"prompt {len(self.prompt)} eos {self.eos} new {self.max_new_tokens} "
                f"{self.preset}; T={self.temperature} p={self.top_p} k={self.top_k} "
                f"{self.scheme}; W={self.world}. Rerun: python -m pytest -m fuzz "
                f"--fuzz-first-seed {self.seed} --fuzz-cases 1")


def fuzz_rope_name(config):
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return rope.get("rope_type") or rope.get("type") or "default"


def fuzz_rope(rng, family):
    """Random RoPE: default or scaled, the original context (32-64) short enough to matter."""
    kind, theta = rng.choice(FUZZ_ROPE), rng.choice([1e4, 1e5, 5e5])
    original = rng.choice([32, 64])
    params = dict(rope_type=kind or "default", rope_theta=theta)
    if kind in ("linear", "dynamic"):
        params.update(factor=rng.choice([2.0, 4.0]))
    if kind == "llama3":
        params.update(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                      original_max_position_embeddings=original)
    if kind == "yarn":
        params.update(factor=rng.choice([2.0, 4.0]), original_max_position_embeddings=original)
    if family == "deepseek_v3":   # DeepSeek's config reads rope_scaling (YaRN or none)
        return dict(rope_theta=theta, rope_scaling=None if kind != "yarn" else dict(
            type="yarn", factor=params["factor"], original_max_position_embeddings=original,
            beta_fast=rng.choice([1, 32]), beta_slow=1, mscale=1.0,
            mscale_all_dim=rng.choice([0.707, 1.0])))
    return dict(rope_parameters=params)


def fuzz_target_config(rng, family, world):
    V, L = rng.randint(12, 40), rng.randint(7, 9)
    heads = rng.choice([2, 4, 6] if world == 1 else [2, 4])
    base = dict(vocab_size=V, num_hidden_layers=L, num_attention_heads=heads,
                max_position_embeddings=256, rms_norm_eps=rng.choice([1e-6, 1e-5]),
                tie_word_embeddings=rng.random() < 0.3, eos_token_id=None, bos_token_id=None,
                pad_token_id=None, **fuzz_rope(rng, family))
    if family == "deepseek_v3":
        groups = rng.choice([1, 2, 4])
        per_group = rng.choice([2, 3]) if groups > 1 else rng.choice([4, 6])
        kept_groups = rng.randint(1, groups)
        return dict(base, hidden_size=rng.choice([32, 48, 64]), num_key_value_heads=heads,
                    intermediate_size=rng.choice([64, 96]), num_nextn_predict_layers=0,
                    q_lora_rank=rng.choice([None, 16, 32]), kv_lora_rank=rng.choice([8, 16, 24]),
                    qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]),
                    v_head_dim=rng.choice([8, 12, 16]), n_routed_experts=groups * per_group,
                    n_group=groups, topk_group=kept_groups,
                    num_experts_per_tok=rng.randint(1, kept_groups * per_group),
                    n_shared_experts=rng.choice([1, 2]), first_k_dense_replace=rng.randint(0, 3),
                    moe_intermediate_size=rng.choice([16, 32]), norm_topk_prob=rng.random() < 0.8,
                    routed_scaling_factor=round(rng.uniform(1.0, 3.0), 3))
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0 and d % world == 0])
    config = dict(base, hidden_size=heads * rng.choice([8, 12, 16]), num_key_value_heads=kv,
                  intermediate_size=rng.choice([32, 64, 96]))
    if family == "qwen3" or rng.random() < 0.3:   # a head_dim that is not hidden / heads
        config["head_dim"] = rng.choice([8, 16, 24])
    if family == "mistral":
        config["sliding_window"] = None
    return config


FUZZ_BATCH_STREAM = 1_000_003   # the second prompt of a case's batch: Random(seed + this)


def fuzz_case(seed):
    rng = random.Random(seed)
    world = 2 if seed % FUZZ_W2_EVERY == FUZZ_W2_EVERY - 1 else 1
    # each family equally often, and at W = 2 too (seed % 5 alone would make every W = 2
    # case, seed % 10 == 9, the same family)
    family = FUZZ_FAMILIES[(seed + seed // len(FUZZ_FAMILIES)) % len(FUZZ_FAMILIES)]
    config = fuzz_target_config(rng, family, world)
    V, D = config["vocab_size"], config["hidden_size"]
    heads = rng.choice([h for h in (2, 4, 8) if D % (2 * h) == 0])   # even head widths
    draft = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=D,
                 intermediate_size=rng.choice([32, 64, 128]), num_attention_heads=heads,
                 num_key_value_heads=rng.choice([d for d in (1, 2, 4, 8) if heads % d == 0]),
                 rms_norm_eps=1e-6, max_position_embeddings=256,
                 rope_theta=rng.choice([1e4, 5e5]), vocab_size=V, tie_word_embeddings=False)
    kept = sorted(rng.sample(range(V), rng.randint(V // 2, V - 1))) if rng.random() < 0.6 \
        else None
    top_k = rng.randint(1, min(4, len(kept) if kept else V))
    depth = rng.randint(1, 5)
    shape = (top_k, depth, rng.randint(2, min(top_k + depth * top_k ** 2 + 1, 40)))
    return FuzzCase(
        seed=seed, family=family, config=config, draft=draft, kept=kept,
        sharpen=rng.random() < 0.6, shape=shape,
        prompt=[rng.randrange(V) for _ in range(rng.randint(1, 20))],
        eos=rng.randrange(V) if rng.random() < 0.4 else None,
        max_new_tokens=rng.randint(1, 48), preset=rng.choice(FUZZ_PRESETS),
        temperature=rng.choice([0.5, 0.8, 1.0, 1.3]),
        top_p=1.0 if rng.random() < 0.5 else round(rng.uniform(0.6, 0.98), 3),
        top_k=0 if rng.random() < 0.6 else rng.randint(1, V),
        scheme=rng.choice(["tree", "chain"]), world=world)


def fuzz_hf_model(case):
    std = 0.2 if case.family == "deepseek_v3" else (0.2, 0.25, 0.3)[case.seed % 3]
    return tiny_model(case.family, case.seed, std, **case.config)


def fuzz_draft(case, target, hf):
    """A random drafter, mostly sharpened by 25 TTT steps on the target's greedy text."""
    draft = tiny_draft(target, case.seed, case.kept, **case.draft)
    if case.sharpen:
        text = torch.cat([torch.tensor(case.prompt), hf_greedy(hf, case.prompt, 32)])
        sharpen(draft, target, text[None], steps=25)
    return draft.eval()


def fuzz_runs(case, target, draft):
    """The two runs of a case -> (greedy tokens, sampled run as plain lists)."""
    prompt = torch.tensor([case.prompt])
    greedy = E.speculative_generate(target, draft, prompt, case.max_new_tokens,
                                    tree=E.TreeShape(*case.shape), eos_token_id=case.eos,
                                    variant=E.resolve_variant(case.preset))
    sampled = E.speculative_generate(
        target, draft, prompt, case.max_new_tokens, temperature=case.temperature,
        top_p=case.top_p, top_k=case.top_k, tree=E.TreeShape(*case.shape), seed=case.seed,
        eos_token_id=case.eos, variant=E.resolve_variant(scheme=case.scheme), record_logits=True)
    rounds = [dict(tokens=r.tree.tokens.tolist(), parents=r.tree.parents.tolist(),
                   uniforms=list(r.uniforms),
                   q=None if r.draft_probs is None else r.draft_probs.double())
              for r in sampled.rounds]
    return greedy.tokens.tolist(), dict(tokens=sampled.tokens.tolist(), rounds=rounds,
                                        first=list(sampled.first_uniforms))


class FuzzBuilt(NamedTuple):
    case: FuzzCase
    hf: object
    target: object
    draft: object
    dir: str              # target/ and draft/ saved here


def fuzz_build(case, root):
    hf = fuzz_hf_model(case)
    hf.save_pretrained(os.path.join(root, "target"))
    target = E.load_target(os.path.join(root, "target"))
    draft = fuzz_draft(case, target, hf)
    E.save_draft(draft, os.path.join(root, "draft"))
    return FuzzBuilt(case, hf, target, draft, root)


# ========================================================================================
# the losslessness fuzzer (continued): the fuzzer's checks: transformers' greedy text, the sampled decisions replayed, batches, W = 2
# ========================================================================================


def top2_gap(target, ids):
    with torch.no_grad():
        top = target(torch.tensor([ids]))[0][0, -1].float().topk(2).values
    return float(top[0] - top[1])


def check_greedy(built, tokens, hf_tokens, what):
    """Token for token equal to transformers, or a near-tie reported with its gap."""
    case = built.case
    if tokens == hf_tokens:
        return
    i = next((i for i, (a, b) in enumerate(zip(tokens, hf_tokens)) if a != b), None)
    assert i is not None, f"{what}: lengths {len(tokens)} vs {len(hf_tokens)}; {case.describe()}"
    # a near-tie in both implementations: our top-2 gap, and transformers' gap between its
    # token and ours (so that logits flattened by a bug cannot excuse themselves)
    gap = top2_gap(built.target, case.prompt + tokens[:i])
    with torch.no_grad():
        hf_logits = built.hf(torch.tensor([case.prompt + tokens[:i]])).logits[0, -1].float()
    hf_gap = float(hf_logits[hf_tokens[i]] - hf_logits[tokens[i]])
    assert gap < NEAR_TIE and hf_gap < NEAR_TIE, (
        f"{what}: token {i} is {tokens[i]}, transformers' {hf_tokens[i]} (our top-2 gap "
        f"{gap:.2e}, transformers' gap between the two {hf_gap:.2e}); {case.describe()}")
    warnings.warn(NearTie(f"{what} near-tie at token {i}: top-2 gap {gap:.1e}; "
                          f"{case.describe()}"))


def replay_sampled(built, run, sampling):
    """The sampled run decided afresh by the documented rules -> (tokens, margin, rounds)."""
    case, tokens = built.case, run["tokens"]
    for r in run["rounds"]:  # each round verified a full tree, or a chain of depth + 1 drafts
        assert len(r["tokens"]) == (case.shape[1] + 2 if case.scheme == "chain"
                                    else case.shape[2]), case.describe()
    ids = torch.tensor([case.prompt + tokens])
    with torch.no_grad():
        p_all = hf_warped_probs(built.hf(ids, attention_mask=torch.ones_like(ids)).logits[0],
                                sampling)
    T, out, margins = len(case.prompt), [], []

    def p_next():  # the distribution of the next output token, given the output so far
        return p_all[T - 1 + len(out)].clone()

    def emit(token):  # True when the replay has produced as much as the run did
        out.append(token)
        if out == tokens[:len(out)]:
            margins.clear()        # only the decisions behind a wrong token may excuse it
            return len(out) == case.max_new_tokens or token == case.eos
        return True

    def result():
        return out, min(margins, default=1.0), used

    used = 0
    token, margin = pick(p_next(), run["first"][0])
    margins.append(margin)
    if emit(token):
        return result()
    for used, r in enumerate(run["rounds"], 1):
        coins, p = iter(r["uniforms"]), p_next()
        if case.scheme == "chain":
            drafts = r["tokens"][1:]
            for i, x in enumerate(drafts):              # the drafts came from q by inverse CDF
                assert pick(r["q"][i], next(coins))[0] == x, case.describe()
            for i, x in enumerate(drafts):
                u = next(coins)
                margins.append(abs(u * float(r["q"][i, x]) - float(p[x])))
                if u * r["q"][i, x] >= p[x]:
                    residual = (p - r["q"][i]).clamp(min=0)
                    token, margin = pick(residual if residual.sum() > 0 else p, next(coins))
                    break
                if emit(x):
                    return result()
                p = p_next()
            else:
                token, margin = pick(p, next(coins))
        else:
            node, kids = 0, {}
            for child, parent in enumerate(r["parents"]):
                kids.setdefault(parent, []).append(child)
            while True:
                for child in kids.get(node, []):
                    x, u = r["tokens"][child], next(coins)
                    margins.append(abs(u - float(p[x])))
                    if u < p[x]:
                        break
                    p[x] = 0
                    p = p / p.sum()
                else:
                    break                                 # all rejected, or a leaf
                node = child
                if emit(x):
                    return result()
                p = p_next()
            token, margin = pick(p, next(coins))
        margins.append(margin)
        if emit(token):
            return result()
        assert next(coins, None) is None, f"round used fewer uniforms than recorded; " \
                                          f"{case.describe()}"
    return result()     # the rounds ran out before max_new_tokens or EOS: check_sampled fails


def check_sampled(built, run, what):
    case = built.case
    stream = coins(case.seed)     # the documented stream, drawn here, not by the code
    used = run["first"] + [u for r in run["rounds"] for u in r["uniforms"]]
    assert used == [next(stream) for _ in used], f"{what}: not the seeded uniforms; " \
                                                 f"{case.describe()}"
    sampling = E.Sampling(temperature=case.temperature, top_k=case.top_k, top_p=case.top_p,
                          warpers=E.OFFICIAL_ORDER)      # the official code's warper order
    replayed, margin, rounds = replay_sampled(built, run, sampling)
    if replayed == run["tokens"]:
        finished = len(replayed) == case.max_new_tokens or replayed[-1] == case.eos
        assert finished and rounds == len(run["rounds"]), (
            f"{what}: {len(replayed)} tokens from {len(run['rounds'])} rounds, but the run "
            f"{'ends after round ' + str(rounds) if finished else 'stopped early'}; "
            f"{case.describe()}")
        return
    assert margin < COIN_TIE, (f"{what}: output {run['tokens']} but its uniforms give "
                               f"{replayed} (closest decision {margin:.1e}); {case.describe()}")
    warnings.warn(NearTie(f"{what} near-tie: a uniform within {margin:.1e} of p; "
                          f"{case.describe()}"))


def pytest_generate_tests(metafunc):
    if "fuzz_seed" in metafunc.fixturenames:
        first = metafunc.config.getoption("fuzz_first_seed")
        seeds = range(first, first + metafunc.config.getoption("fuzz_cases"))
        metafunc.parametrize("fuzz_seed", seeds, ids=[f"seed{s}" for s in seeds])


@pytest.fixture(scope="module")
def fuzz_w2(request, tmp_path_factory):
    """{seed: [rank 0 runs, rank 1 runs]}: this session's W = 2 cases, one torchrun."""
    first = request.config.getoption("fuzz_first_seed")
    cases = [fuzz_case(s) for s in range(first, first + request.config.getoption("fuzz_cases"))]
    cases = [c for c in cases if c.world == 2]

    def build(root):
        for case in cases:
            fuzz_build(case, str(root / str(case.seed)))
        job = [(case.seed, str(root / str(case.seed))) for case in cases]
        ranks = run_workers(fuzz_worker, job, root, timeout=3600)
        return {seed: [ranks[0][seed], ranks[1][seed]] for seed in ranks[0]}
    return built_once(tmp_path_factory, "fuzz_w2", build)


def fuzz_worker(job, rank):
    results = {}
    for seed, root in job:
        target = E.load_target(os.path.join(root, "target"))
        draft = E.load_draft(os.path.join(root, "draft"), target)
        results[seed] = fuzz_runs(fuzz_case(seed), target, draft)
    return results


def check_batched(built, greedy, sampled):
    """Batched with another prompt: row 0 equals the single runs, row 1 transformers' greedy."""
    case = built.case
    rng = random.Random(case.seed + FUZZ_BATCH_STREAM)
    other = [rng.randrange(case.config["vocab_size"]) for _ in range(rng.randint(1, 20))]
    other += [0] * (len(other) == len(case.prompt))       # a different length, always
    prompts = [torch.tensor([case.prompt]), torch.tensor([other])]
    shape = E.TreeShape(*case.shape)
    rows = E.speculative_generate_batch(built.target, built.draft, prompts, case.max_new_tokens,
                                        tree=shape, eos_token_id=case.eos,
                                        variant=E.resolve_variant(case.preset))
    assert rows[0].tokens.tolist() == greedy, f"batched greedy row 0; {case.describe()}"
    hf_other = hf_greedy(built.hf, other, case.max_new_tokens, case.eos).tolist()
    check_greedy(built._replace(case=case._replace(prompt=other)), rows[1].tokens.tolist(),
                 hf_other, "batched greedy row 1")
    rows = E.speculative_generate_batch(
        built.target, built.draft, prompts, case.max_new_tokens, temperature=case.temperature,
        top_p=case.top_p, top_k=case.top_k, tree=shape, seed=case.seed, eos_token_id=case.eos,
        variant=E.resolve_variant(scheme=case.scheme))
    assert rows[0].tokens.tolist() == sampled["tokens"], f"batched sampled row 0; {case.describe()}"


@pytest.mark.fuzz
def test_fuzz_greedy_equals_transformers_and_samples_replay(fuzz_seed, tmp_path, request):
    # greedy: token for token transformers' greedy generate (with its KV cache); sampled:
    # the output is what the seeded uniforms give under the documented rules, with
    # transformers' distributions. W = 2 cases: the same from a torchrun launch, both ranks.
    case = fuzz_case(fuzz_seed)
    built = fuzz_build(case, str(tmp_path))
    hf = hf_greedy(built.hf, case.prompt, case.max_new_tokens, case.eos).tolist()
    greedy, sampled = fuzz_runs(case, built.target, built.draft)
    check_greedy(built, greedy, hf, "greedy")
    check_sampled(built, sampled, "sampled")
    check_batched(built, greedy, sampled)
    if case.world == 2:
        for rank, (greedy2, sampled2) in enumerate(request.getfixturevalue("fuzz_w2")[case.seed]):
            check_greedy(built, greedy2, hf, f"greedy at W=2, rank {rank}")
            check_sampled(built, sampled2, f"sampled at W=2, rank {rank}")


# ========================================================================================
# the file's structure: Part I (the method) never calls Part II (tools); the torchrun workers
# ========================================================================================


def file_parts():
    """(Part I's top-level nodes, Part II's top-level names, all top-level nodes), split at
    the 'PART II' banner."""
    with open(E.__file__) as f:
        source = f.read()
    wall = next(i + 1 for i, line in enumerate(source.splitlines())
                if line.startswith("#") and "PART II" in line)
    body = ast.parse(source).body
    part2 = set()
    for node in body:
        if node.lineno > wall:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                part2.add(node.name)
            elif isinstance(node, ast.Assign):
                part2.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return [node for node in body if node.lineno < wall], part2, body


PROJECT_MODULES = ("eagle3_ref", "eagle3_tools", "eagle3_engines", "test_eagle3_ref",
                   "test_eagle3_scaffold", "test_eagle3_tools", "test_eagle3_engines")


def imported_modules(path):
    """Top-level module names a file imports, wherever the import statement stands."""
    with open(path) as f:
        tree = ast.parse(f.read())
    return ({a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names} |
            {n.module.split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.ImportFrom) and n.module})


def test_part_one_refers_to_no_name_of_part_two_and_the_reference_imports_no_project_file():
    part1, part2, body = file_parts()
    defined1 = {n.name for n in part1 if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    # the wall sits where it should: the method above, the IO and tools below
    assert {"speculative_generate", "ttt_loss", "grow_tree", "Target", "Draft"} <= defined1
    assert {"load_target", "load_draft", "save_draft", "main"} <= part2
    crossings = sorted({(getattr(node, "name", f"line {node.lineno}"), ref.id)
                        for node in part1 for ref in ast.walk(node)
                        if isinstance(ref, ast.Name) and ref.id in part2})
    assert not crossings, f"Part I refers to Part II: {crossings}"
    # nor does Part II change what Part I's names hold: no item set, no update() of a table
    names1 = {t.id for n in part1 if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)} | defined1
    rewrites = sorted({n.lineno for node in body if node not in part1 for n in ast.walk(node)
                       if (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) or
                           isinstance(n, ast.Attribute) and n.attr == "update")
                       and isinstance(n.value, ast.Name) and n.value.id in names1})
    assert not rewrites, f"Part II rewrites Part I's tables at lines {rewrites}"
    here = os.path.dirname(os.path.abspath(E.__file__))  # no project import, none of the tools
    assert not imported_modules(E.__file__) & set(PROJECT_MODULES)
    # the workbench is imported by the engines module alone (SPEC §1), the engines by none
    for name in os.listdir(here):
        if name.endswith(".py") and not name.startswith("test_"):
            imports = imported_modules(os.path.join(here, name))
            assert "eagle3_engines" not in imports, name
            assert "eagle3_tools" not in imports or name == "eagle3_engines.py", name


def test_reference_manual_api_names_exist_with_the_parameters_it_lists():
    # each row of the reference manual's Public API table: a name, and maybe its parameters
    with open(os.path.join(os.path.dirname(os.path.abspath(E.__file__)), "docs",
                           "reference.md")) as f:
        section = f.read().split("## Public API", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([A-Za-z_][\w.]*)(\((.*?)\))?`", section, re.M)
    assert len(rows) >= 8, rows
    for name, paren, params in rows:
        obj = E
        for part in name.split("."):          # a module's call runs its forward
            obj = getattr(obj, "forward" if part == "__call__" else part)  # or a ghost: fails
        if paren:
            shown = str(inspect.signature(obj))[1:-1]
            shown = re.sub(r"\bself, ", "", shown)
            assert re.sub(r"\s+", " ", params) == shown, (name, params, shown)


def finish_worker():
    """Leave a torchrun worker without interpreter teardown (gloo ranks sometimes abort there)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ========================================================================================
# exact in low precision (make_exact): in bf16, each verify row gets its decode step's bits
# ========================================================================================
# Every check compares the exact path against decoding one token per forward (greedy
# decoding, or decode steps along a given text) on the same served target, and the plain
# bf16 path is the negative control: it must part somewhere, or the checks prove nothing.

EXACT_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "ds-v3", "kimi"]
EXACT_PROMPTS = 4         # random prompts per family (lengths 3..10)
EXACT_NEW = 20            # tokens decoded per prompt
EXACT_SHAPES = [(2, 3, 8), (1, 4, 6), (3, 2, 10)]   # trees, and a chain (tree top-k 1)


def memorized_prompts():
    """The prompts whose greedy text bf16_pair's drafter learns."""
    return [random_prompt(700 + j, 6) for j in range(3)]


@pytest.fixture(scope="module")
def bf16_pair(zoo):
    """name -> (plain bf16, exact bf16, their drafters); the targets are new on every call."""
    drafts = {}

    def pair(name):
        if name not in drafts:
            target32 = E.load_target(zoo.dir(name))
            texts = [torch.cat([p[0], E.greedy_generate(target32, p, 24)])
                     for p in memorized_prompts()]
            drafts[name] = sharpen(tiny_draft(target32, 0), target32, torch.stack(texts))
        plain = E.load_target(zoo.dir(name), dtype=torch.bfloat16)
        exact = E.make_exact(E.load_target(zoo.dir(name), dtype=torch.bfloat16))
        return plain, exact, copy_draft(drafts[name], plain), copy_draft(drafts[name], exact)
    return pair


def copy_draft(draft, target):
    """`draft`'s weights in a bf16 drafter that shares `target`'s embedding."""
    new = E.new_draft(draft.cfg, target)
    state = {k: v for k, v in draft.state_dict().items() if E.owned(draft, k)}
    new.load_state_dict(state, strict=False)
    return new.eval()


def exact_prompts(family_index, n=EXACT_PROMPTS):
    g = torch.Generator().manual_seed(900 + family_index)
    return [torch.randint(0, VOCAB, (1, int(torch.randint(3, 11, (), generator=g))),
                          generator=g) for _ in range(n)]


def decode_step_logits(target, ids, n):
    """Decode steps after a prefill of n -> (T - n, V): row j picks token n + j."""
    cache = target.new_cache(ids.shape[1])
    with torch.no_grad():
        logits, _ = target(ids[:, :n], cache=cache, aux_layers=())
        rows = [logits[0, -1]]
        for i in range(n, ids.shape[1] - 1):
            logits, _ = target(ids[:, i:i + 1], cache=cache, start=i, aux_layers=())
            rows.append(logits[0, -1])
    return torch.stack(rows).float()


def path_rows(result):
    """(output position, round, node) per accepted node: path[k] holds token r + k + 1."""
    rows, root = [], 0
    for i, r in enumerate(result.rounds):
        rows += [(root + k + 1, i, int(node)) for k, node in enumerate(r.path)]
        root += r.accepted + 1
    return rows


def partings(target, draft, prompts):
    """The (prompt, shape, preset) where greedy speculation parts from greedy decoding; deepest."""
    parted, deepest = [], 0
    for i, ids in enumerate(prompts):
        greedy = E.greedy_generate(target, ids, EXACT_NEW).tolist()
        for j, shape in enumerate(EXACT_SHAPES):
            preset = list(E.PRESETS)[(i + j) % len(E.PRESETS)]
            out = E.speculative_generate(target, draft, ids, EXACT_NEW, tree=E.TreeShape(*shape),
                                         variant=E.resolve_variant(preset))
            if out.tokens.tolist() != greedy:
                parted.append((i, shape, preset))
            deepest = max(deepest, *out.accept_lengths)
    return parted, deepest


@pytest.mark.parametrize("name", EXACT_FAMILIES)
def test_exact_bf16_greedy_speculation_equals_greedy_decoding_every_preset_tree_and_chain(
        bf16_pair, name):
    # Each prompt, tree or chain (tree top-k 1) and preset in bf16 on the exact path:
    # speculation equals the same target's greedy decoding token for token.
    _, exact, _, exact_draft = bf16_pair(name)
    prompts = exact_prompts(EXACT_FAMILIES.index(name)) + memorized_prompts()[:1]
    parted, deepest = partings(exact, exact_draft, prompts)
    assert parted == [], name
    assert deepest >= 3          # verified rows went deep


class RowCountRounding(torch.nn.Module):
    """A planted row-dependent operation: multi-row calls rounded to a grid of `step`."""

    def __init__(self, inner, step):
        super().__init__()
        self.inner, self.step = inner, step

    @property
    def weight(self):
        return self.inner.weight

    def forward(self, x):
        y = self.inner(x)
        return y if y[..., 0].numel() == 1 else torch.round(y / self.step) * self.step


def test_a_row_dependent_operation_makes_the_same_runs_part(bf16_pair):
    # The negative control of the test above. Whether plain bf16 parts depends on the CPU's
    # kernels (an AVX2 EPYC: 52 of 162 runs; others none), so the fault is planted: an
    # lm_head that rounds multi-row calls coarsely must make the same harness see a parting.
    _, exact, _, exact_draft = bf16_pair("llama")
    prompts = exact_prompts(0) + memorized_prompts()[:1]    # llama's: 0 partings above
    exact.lm_head = RowCountRounding(exact.lm_head, step=1.0)
    parted, _ = partings(exact, exact_draft, prompts)
    assert len(parted) > 0


def test_exact_verify_rows_hand_acceptance_the_decode_steps_probabilities(bf16_pair):
    # Sampled: at every accepted node the verify row's logits (so the warped probabilities
    # acceptance draws against) are the decode step's, bit for bit; a planted row-dependent
    # lm_head (the control) makes the same check see them differ.
    plain, exact, plain_draft, exact_draft = bf16_pair("llama")
    planted = E.make_exact(plain)
    planted.lm_head = RowCountRounding(planted.lm_head, step=1.0)
    sampling = E.Sampling(0.8, 0, 0.95, E.OFFICIAL_ORDER)
    differ = Counter()
    for seed, ids in enumerate(exact_prompts(50, 4)):
        for served, target, draft in (("exact", exact, exact_draft),
                                      ("planted", planted, plain_draft)):
            out = E.speculative_generate(target, draft, ids, EXACT_NEW, temperature=0.8,
                                         top_p=0.95, tree=E.TreeShape(2, 3, 8), seed=seed,
                                         record_logits=True)
            steps = decode_step_logits(target, torch.cat([ids, out.tokens[None]], 1),
                                       ids.shape[1])
            for position, r, node in path_rows(out):
                if position >= len(out.tokens):
                    continue                             # past the budget: never used
                row = out.rounds[r].logits[node]
                same = torch.equal(row, steps[position])
                differ[served] += not same
                if served == "exact":
                    assert same, (seed, position)
                    assert torch.equal(E.warped_probs(row, sampling),
                                       E.warped_probs(steps[position], sampling))
    assert differ["planted"] > 0, "the planted row-dependent lm_head went unseen"


def test_exact_needle_in_a_batch_equals_itself_alone_and_its_greedy_decoding(bf16_pair):
    # One prompt alone and at a random slot of a batch of 4 of other lengths (dense, and
    # MLA + MoE): the same tokens and verify logits bit for bit, every row its own greedy
    # decoding; the plain bf16 batch rounds the needle otherwise somewhere (the control).
    g = torch.Generator().manual_seed(11)
    needle = random_prompt(77, 7)
    logits_differ = 0
    for name in ("llama", "ds-v3"):
        plain, exact, plain_draft, exact_draft = bf16_pair(name)
        for trial in range(2):
            others = [random_prompt(80 + 3 * trial + k, int(torch.randint(3, 12, (), generator=g)))
                      for k in range(3)]
            slot = int(torch.randint(0, 4, (), generator=g))
            prompts = others[:slot] + [needle] + others[slot:]
            for target, draft in ((exact, exact_draft), (plain, plain_draft)):
                run = dict(tree=E.TreeShape(2, 3, 8), record_logits=True)
                alone = E.speculative_generate(target, draft, needle, EXACT_NEW, **run)
                batch = E.speculative_generate_batch(target, draft, prompts, EXACT_NEW, **run)
                same = [torch.equal(a.logits, b.logits)
                        for a, b in zip(alone.rounds, batch[slot].rounds)]
                if target is plain:
                    logits_differ += not all(same)
                    continue
                assert batch[slot].tokens.tolist() == alone.tokens.tolist(), (name, trial, slot)
                assert all(same), (name, trial, slot)
                for ids, row in zip(prompts, batch):
                    assert torch.equal(row.tokens, E.greedy_generate(exact, ids, EXACT_NEW))
    assert logits_differ > 0, "the plain bf16 batch rounded the needle as alone every time"


def test_attend_rows_is_each_rows_softmax_over_its_slots_and_refuses_unshared_prefixes():
    # B=2 rows of 3 queries after 5 cached slots, tree masks over the new ones: each row is
    # the written-out fp32 softmax over the slots it sees; rows that see different cached
    # slots (not a decode step, chain or tree after a prefill) are refused
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, n, 8, generator=g) for h, n in ((4, 3), (2, 8), (2, 8)))
    new = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    seen = torch.cat([torch.ones(3, 5, dtype=torch.bool), new], 1)
    seen = torch.stack([seen, torch.cat([seen[:, :5] & (torch.arange(5) != 2), new], 1)])
    bias = torch.zeros(2, 1, 3, 8).masked_fill(~seen[:, None], -math.inf)
    y = E.attend_rows(q, k, v, bias)
    for b, h, t in itertools.product(range(2), range(4), range(3)):
        slots = seen[b, t].nonzero()[:, 0]
        w = torch.softmax(q[b, h, t] @ k[b, h // 2, slots].T / math.sqrt(8), -1)
        assert_close(y[b, h, t], w @ v[b, h // 2, slots], f"row {b}, head {h}, query {t}")
    seen[1, 2, 0] = False                                   # query 2 alone drops a cached slot
    bias = torch.zeros(2, 1, 3, 8).masked_fill(~seen[:, None], -math.inf)
    with pytest.raises(E.Eagle3Error, match="different ones"):
        E.attend_rows(q, k, v, bias)


def test_row_invariant_linear_a_row_has_the_bits_of_every_call_it_sits_in():
    # A row's product alone (a decode step) and at any place in a call of 2..16 rows (a
    # verify) has the same bits. Plain bf16 F.linear does not: a Zen 4's kernels rounded 2
    # to 6 of these 3,000 rows differently in calls of 1 or 2 rows than of 3 or more.
    g = torch.Generator().manual_seed(5)
    for n_out in (24, 32):
        linear = torch.nn.Linear(64, n_out, bias=False)
        linear.weight.data = torch.randn(n_out, 64, generator=g).bfloat16()
        served = E.RowInvariantLinear(linear)
        rows = torch.randn(3000, 64, generator=g).bfloat16()
        alone = torch.stack([served(row[None, None])[0, 0] for row in rows])
        for M in (2, 3, 8, 16):
            calls = torch.randn(len(rows), M, 64, generator=g).bfloat16()
            place = torch.arange(len(rows)) % M
            calls[torch.arange(len(rows)), place] = rows
            among = torch.stack([served(call[None])[0, p] for call, p in zip(calls, place)])
            assert torch.equal(among, alone), (n_out, M)


def test_make_exact_twice_is_a_no_op_what_it_cannot_serve_or_an_fp32_drafter_is_one_line(zoo):
    target = E.make_exact(E.load_target(zoo.dir("ds-v3"), dtype=torch.bfloat16))
    modules = list(target.modules())
    assert E.make_exact(target) is target
    assert list(target.modules()) == modules                    # nothing new, nothing nested
    assert not any(isinstance(m, torch.nn.Linear) for m in modules)
    assert all(type(m.weight) is torch.nn.Parameter for m in modules
               if isinstance(m, E.RowInvariantLinear))
    ids = random_prompt(5, 6)
    once = E.make_exact(E.load_target(zoo.dir("ds-v3"), dtype=torch.bfloat16))
    assert torch.equal(target(ids)[0], once(ids)[0])          # served as once, bit for bit
    target = E.load_target(zoo.dir("llama"), dtype=torch.bfloat16)  # what it cannot serve
    with pytest.raises(E.Eagle3Error, match="serves a target"):
        E.make_exact(tiny_draft(target, 0))
    draft, ids = tiny_draft(target, 0).float(), random_prompt(1, 5)  # nor a float32 drafter
    for run in (lambda: E.speculative_generate(target, draft, ids, 4),
                lambda: E.speculative_generate_batch(target, draft, [ids, ids], 4)):
        with pytest.raises(E.Eagle3Error, match="drafter's weights are float32 but the "
                                                "target's are bfloat16.*dtype=torch.bfloat16"):
            run()

    class Transposed(torch.nn.Module):     # a linear in another layout (the workbench's
        def __init__(self, linear):        # columns layout stores W^T)
            super().__init__()
            self.weight_t = torch.nn.Parameter(linear.weight.t().contiguous())

    target.model.layers[1].mlp.up_proj = Transposed(target.model.layers[1].mlp.up_proj)
    with pytest.raises(E.Eagle3Error, match=r"model\.layers\.1\.mlp\.up_proj.*Transposed"):
        E.make_exact(target)


# ========================================================================================
# exact in low precision (continued): exact under torchrun, in the fuzzer, and through the command line
# ========================================================================================

# W = 2 (gloo) needs nothing (a sum of two is one addition); W = 3 sums in rank order.
EXACT_TP = {2: dict(num_attention_heads=4, num_key_value_heads=2),
            3: dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48,
                    intermediate_size=96)}
EXACT_TP_DS = dict(q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                   v_head_dim=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                   n_group=2, topk_group=1, first_k_dense_replace=2, moe_intermediate_size=24,
                   intermediate_size=96)


def exact_tp_worker(job, rank):
    """Per rank: each bf16 target on the exact path over W ranks; greedy, speculation."""
    results = {}
    for name, (target_dir, draft_dir) in job["models"].items():
        target = E.make_exact(E.load_target(target_dir, dtype=torch.bfloat16))
        draft = E.load_draft(draft_dir, target)
        results[name] = dict(ordered=target.tp.reduce is E.sum_in_rank_order, runs=[
            (E.greedy_generate(target, ids, EXACT_NEW).tolist(),
             [E.speculative_generate(target, draft, ids, EXACT_NEW,
                                     tree=E.TreeShape(*shape)).tokens.tolist()
              for shape in EXACT_SHAPES[:2]])
            for ids in job["prompts"]])
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_exact_bf16_under_torchrun_greedy_speculation_equals_greedy_decoding(tmp_path, world):
    models = {}
    for family, extra in (("llama", {}), ("deepseek_v3", EXACT_TP_DS)):
        sizes = dict(EXACT_TP[world], **extra)
        if family == "deepseek_v3":            # MLA: as many kv heads as query heads
            sizes["num_key_value_heads"] = sizes["num_attention_heads"]
        hf = tiny_model(family, world, 0.25, **sizes)
        hf.save_pretrained(tmp_path / family)
        target = E.load_target(str(tmp_path / family))
        prompt = random_prompt(40 + world, 6)
        text = torch.cat([prompt[0], hf_greedy(hf, prompt, 24)])
        E.save_draft(sharpen(tiny_draft(target, world), target, text[None]),
                     tmp_path / f"{family}-draft")
        models[family] = (str(tmp_path / family), str(tmp_path / f"{family}-draft"))
    prompts = [random_prompt(40 + world + k, 4 + k) for k in range(2)]
    ranks = run_workers(exact_tp_worker, dict(models=models, prompts=prompts), tmp_path,
                        timeout=1200, world=world)
    for family in models:
        assert all(r[family] == ranks[0][family] for r in ranks), family  # every rank alike
        assert ranks[0][family]["ordered"] == (world > 2)
        for greedy, speculative in ranks[0][family]["runs"]:
            assert all(s == greedy for s in speculative), family


class PlainParted(UserWarning):
    """The plain bf16 path parted from greedy decoding: the fuzzer's negative control."""


@pytest.mark.fuzz
def test_fuzz_bf16_exact_greedy_speculation_equals_greedy_decoding(fuzz_seed, tmp_path):
    # The fuzzer's case in bf16 (W = 1), exact path: greedy speculation alone and as row 0
    # of a batch of two equals greedy decoding; plain bf16's partings are reported (control).
    case = fuzz_case(fuzz_seed)
    hf = fuzz_hf_model(case)
    hf.save_pretrained(tmp_path / "target")
    draft = fuzz_draft(case, E.load_target(str(tmp_path / "target")), hf)
    prompt, n = torch.tensor([case.prompt]), case.max_new_tokens
    other = torch.tensor([[(t + 1) % case.config["vocab_size"] for t in case.prompt] + [0]])
    run = dict(tree=E.TreeShape(*case.shape), eos_token_id=case.eos,
               variant=E.resolve_variant(case.preset))
    for served in ("exact", "plain"):
        target = E.load_target(str(tmp_path / "target"), dtype=torch.bfloat16)
        target = E.make_exact(target) if served == "exact" else target
        bf16_draft = copy_draft(draft, target)
        greedy = E.greedy_generate(target, prompt, n, case.eos).tolist()
        out = E.speculative_generate(target, bf16_draft, prompt, n, **run)
        if served == "plain":
            if out.tokens.tolist() != greedy:
                warnings.warn(PlainParted(f"plain bf16 parted; {case.describe()}"))
            continue
        assert out.tokens.tolist() == greedy, f"exact bf16; {case.describe()}"
        rows = E.speculative_generate_batch(target, bf16_draft, [prompt, other], n, **run)
        assert rows[0].tokens.tolist() == greedy, f"exact bf16 batch row 0; {case.describe()}"


def test_exact_is_a_switch_off_by_default_golden_records_it_and_check_reruns_the_exact_path(
        zoo, tmp_path):
    parser = E.build_parser()                # of generate, golden and the main job
    for argv in (["generate", "--prompt", "hi"], ["golden"], []):
        assert parser.parse_args(argv).exact is False
        assert parser.parse_args(argv[:1] + ["--exact"] + argv[1:]).exact is True
    # golden --exact in bf16 writes exact: true in the header, --check re-runs it (a match);
    # the file without the key (as traces before it) diverges: --check followed the key.
    target = E.load_target(zoo.dir("llama"))
    E.save_draft(tiny_draft(target, 2), tmp_path / "draft")
    trace = tmp_path / "exact.safetensors"
    args = ["--target", zoo.dir("llama"), "--draft", tmp_path / "draft", "--dtype", "bfloat16",
            "--prompt-ids", "3,1,4,1,5,9", "--max-new-tokens", 12, "--tree-top-k", 2,
            "--depth", 2, "--total-tokens", 6]
    assert cli_here("golden", "--out", trace, "--exact", *args).returncode in (0, None)
    header, tensors = golden_read(trace)
    assert header["config"]["exact"] is True and header["version"] == 1
    check = cli_here("golden", "--check", trace)
    assert check.returncode == 0 and "match" in check.stdout, check.stdout + check.stderr
    del header["config"]["exact"]
    golden_write(tmp_path / "plain.safetensors", header, tensors)
    check = cli_here("golden", "--check", tmp_path / "plain.safetensors")
    assert check.returncode == 1 and "first divergence" in check.stdout, check.stdout


WORKERS = {w.__name__: w for w in (tp_worker, ds_tp_worker, train_dp_worker, fuzz_worker,
                                        exact_tp_worker)}

if __name__ == "__main__":  # a torchrun rank started by run_workers: WORKER DIR (DIR/job.pt)
    name, root = sys.argv[1:3]
    rank = E.init_distributed()
    result = WORKERS[name](torch.load(os.path.join(root, "job.pt")), rank)
    torch.save(result, os.path.join(root, f"rank{rank}.pt"))
    finish_worker()
