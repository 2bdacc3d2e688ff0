"""
eagle3_ref.py: a single-file reference implementation of EAGLE-3 speculative decoding
(Li et al., 2025, "EAGLE-3: Scaling up Inference Acceleration of Large Language Models via
Training-Time Test").

The file reads top to bottom like the method: target model (with tensor parallelism) ->
draft head -> dynamic draft tree -> tree verification and acceptance -> generation ->
training-time test -> golden traces -> command line.

Symbols used in shapes and comments:
    B batch, T time (sequence), S cache length, D hidden size, V vocab (target),
    Vd draft vocab, H query heads, Hkv key/value heads, hs head size, I MLP width,
    L target layers, W world size (tensor-parallel ranks), N tree nodes (root included),
    K top-k per tree level, n accepted prefix length (tokens already in the KV cache).

Launch lines:
    python eagle3_ref.py                                    # tiny end-to-end demo on CPU
    torchrun --nproc_per_node=2 eagle3_ref.py               # same, tensor parallel (gloo)
    python eagle3_ref.py verify-tp --target DIR             # TP logits == 1-process logits
    torchrun --nproc_per_node=8 eagle3_ref.py generate \\
        --target meta-llama/Llama-3.1-8B-Instruct --draft yuhuili/EAGLE3-LLaMA3.1-Instruct-8B \\
        --prompt "Hello" --chat                             # real checkpoints (local dirs), NCCL
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------
# constants

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # config.json model_type
MIN_LAYERS_FOR_AUX = 7      # aux layers (2, L//2, L-3) are distinct only for L >= 7
RUNS_DIR = "runs"           # every generated file lives under here (git-ignored)


class Eagle3Error(ValueError):
    """A wrong input: the message names the value, what was expected and the fix."""


def fail(message):
    raise Eagle3Error(message)


# ----------------------------------------------------------------------------------------
# config


@dataclass
class TargetConfig:
    family: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    qkv_bias: bool             # qwen2 has q/k/v biases
    qk_norm: bool              # qwen3 RMS-normalises q and k per head before RoPE
    tie_embeddings: bool
    max_positions: int         # KV cache length limit (max_position_embeddings / window)
    inv_freq: torch.Tensor     # (hs/2,) RoPE inverse frequencies, exactly as transformers
    rope_scale: float          # transformers' "attention scaling" applied to cos/sin (yarn)

    @property
    def default_aux_layers(self):
        # EAGLE-3 fuses the residual stream *entering* a low, a middle and a high layer
        # (= transformers hidden_states[2], [L//2], [L-3]).
        L = self.n_layers
        return (2, L // 2, L - 3)


def rope_inv_freq(hf_config):
    """RoPE inverse frequencies and cos/sin scale, exactly as transformers computes them.
    The scaled types (llama3, yarn, linear, dynamic, ...) come from transformers' own table,
    so we never re-derive a scaling rule; only the unscaled default is written here."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = hf_config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = hf_config.head_dim
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        fail(f"rope_type={rope_type!r} is not supported; valid: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv_freq.float(), float(scale)


def read_target_config(path):
    """config.json of a Hugging Face model dir -> TargetConfig (via transformers' AutoConfig)."""
    from transformers import AutoConfig
    if not os.path.isfile(os.path.join(path, "config.json")):
        fail(f"no config.json in {path!r}: expected a Hugging Face model directory")
    family = json.load(open(os.path.join(path, "config.json"))).get("model_type")
    if family not in SUPPORTED_FAMILIES:
        fail(f"model_type={family!r} in {path}/config.json is not supported; "
             f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    c = AutoConfig.from_pretrained(path)
    if getattr(c, "hidden_act", "silu") != "silu":
        fail(f"hidden_act={c.hidden_act!r} is not supported; only 'silu' (SwiGLU MLP)")
    if getattr(c, "mlp_bias", False) or (family != "qwen2" and getattr(c, "attention_bias", False)):
        fail("attention_bias/mlp_bias=True is not supported; these families ship without them")
    # Sliding-window attention equals full attention while the cache fits in the window,
    # so we keep the cache inside the window instead of implementing the window.
    window = getattr(c, "sliding_window", None) if family == "mistral" else (
        c.sliding_window if getattr(c, "use_sliding_window", False) else None)
    max_positions = min(c.max_position_embeddings, window or c.max_position_embeddings)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    c.head_dim = head_dim
    inv_freq, rope_scale = rope_inv_freq(c)
    return TargetConfig(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads, head_dim=head_dim,
        intermediate_size=c.intermediate_size, rms_eps=c.rms_norm_eps,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3",
        tie_embeddings=bool(c.tie_word_embeddings), max_positions=max_positions,
        inv_freq=inv_freq, rope_scale=rope_scale)


# ----------------------------------------------------------------------------------------
# distributed helpers
#
# Tensor parallelism (TP) runs one process per device under torchrun. Every rank holds a
# slice of every big weight; the only communication of the forward pass is one all_reduce
# after each row-parallel matmul. Without torchrun everything below degrades to W = 1.


class Dist(NamedTuple):
    rank: int
    local_rank: int
    world: int
    device: torch.device


def init_distributed():
    """Read torchrun's environment and join the process group (nccl on GPUs, else gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # before init_process_group: NCCL binds to this device
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    return Dist(rank, local_rank, world, device)


def world_info():
    """(rank, world) of the current TP group; (0, 1) when no process group exists."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_rank0():
    return world_info()[0] == 0


def print0(*args, **kwargs):
    if is_rank0():
        print(*args, **kwargs, flush=True)


def all_reduce(x, world):
    """Sum the partial results of a row-parallel matmul over the W ranks holding slices."""
    if world > 1:
        dist.all_reduce(x)
    return x


def broadcast0(x):
    """Rank 0's tensor on every rank: decisions (tokens, accepted paths) are made once."""
    if world_info()[1] > 1:
        dist.broadcast(x, src=0)
    return x


# ----------------------------------------------------------------------------------------
# target model
#
# A plain Llama-style decoder written for one process. TP only changes the *local* sizes
# (H/W heads, Hkv/W kv heads, I/W MLP width) and adds the two all_reduce lines.


def rms_norm(x, weight, eps):
    # Normalise in fp32, cast back, then scale: the order transformers (and EAGLE) use.
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(inv_freq, positions, scale, dtype):
    """cos/sin tables for integer positions (T,), computed in fp32 like transformers."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]  # (T, hs/2)
    emb = torch.cat([freqs, freqs], dim=-1)                                       # (T, hs)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x, cos, sin):
    # Non-interleaved "rotate half" convention: pairs (i, i + hs/2) rotate together.
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attend(q, k, v, mask):
    """Softmax attention of q (B, H, T, hs) over k, v (B, Hkv, S, hs); mask (T, S) bool,
    True = may attend. Query head h reads kv head h // (H / Hkv) (GQA)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def causal_mask(T, start, device):
    """(T, start + T) bool: the cached prefix is fully visible, new tokens are causal."""
    new = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return torch.cat([torch.ones(T, start, dtype=torch.bool, device=device), new], dim=1)


class KVCache(NamedTuple):
    """Preallocated keys and values, one slab per layer, written at explicit positions.
    The number of valid entries is not stored here: callers pass it explicitly (`start`)."""
    k: torch.Tensor  # (L, B, Hkv/W, S, hs)
    v: torch.Tensor  # (L, B, Hkv/W, S, hs)

    @property
    def capacity(self):
        return self.k.shape[3]


def new_kv_cache(n_layers, n_kv_heads, head_dim, length, dtype, device, batch=1):
    shape = (n_layers, batch, n_kv_heads, length, head_dim)
    return KVCache(torch.zeros(shape, dtype=dtype, device=device),
                   torch.zeros(shape, dtype=dtype, device=device))


def commit(cache, start, path):
    """Keep the accepted tree nodes: move the K/V of `path` (node indices, root first, in
    the N entries written after `start`) to start, start+1, ... . The official
    `data[..., n:n+a+1] = data[..., path + n]`; indexing copies first, so overlapping
    ranges are safe. Returns the new valid length."""
    src = start + path
    for slab in (cache.k, cache.v):
        slab[:, :, :, start:start + len(path)] = slab[:, :, :, src]
    return start + len(path)


class Attention(nn.Module):
    def __init__(self, cfg, world, in_dim=None, qkv_bias=False, qk_norm=False):
        super().__init__()
        if cfg.n_heads % world or cfg.n_kv_heads % world:
            fail(f"num_attention_heads={cfg.n_heads} and num_key_value_heads={cfg.n_kv_heads} "
                 f"must both be divisible by the world size {world}; "
                 f"use --nproc_per_node in {divisors(math.gcd(cfg.n_heads, cfg.n_kv_heads))}")
        self.world = world  # 1 for the replicated drafter, even under torchrun
        self.H, self.Hkv, self.hs = cfg.n_heads // world, cfg.n_kv_heads // world, cfg.head_dim
        in_dim = in_dim or cfg.hidden_size
        # column-parallel: each rank owns H/W query heads and Hkv/W kv heads
        self.q_proj = nn.Linear(in_dim, self.H * self.hs, bias=qkv_bias)
        self.k_proj = nn.Linear(in_dim, self.Hkv * self.hs, bias=qkv_bias)
        self.v_proj = nn.Linear(in_dim, self.Hkv * self.hs, bias=qkv_bias)
        # row-parallel: each rank owns the input columns of its heads
        self.o_proj = nn.Linear(self.H * self.hs, cfg.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.hs, cfg.rms_eps)
            self.k_norm = RMSNorm(self.hs, cfg.rms_eps)
        self.qk_norm = qk_norm

    def forward(self, x, cos, sin, mask, kv=None, start=0):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.H, self.hs)
        k = self.k_proj(x).view(B, T, self.Hkv, self.hs)
        v = self.v_proj(x).view(B, T, self.Hkv, self.hs).transpose(1, 2)  # (B, Hkv, T, hs)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q.transpose(1, 2), cos, sin)                      # (B, H, T, hs)
        k = apply_rope(k.transpose(1, 2), cos, sin)                      # (B, Hkv, T, hs)
        if kv is not None:  # write the new keys/values at explicit slots, read the prefix
            kv[0][:, :, start:start + T] = k
            kv[1][:, :, start:start + T] = v
            k, v = kv[0][:, :, :start + T], kv[1][:, :, :start + T]      # (B, Hkv, S, hs)
        y = attend(q, k, v, mask).transpose(1, 2).reshape(B, T, self.H * self.hs)
        return all_reduce(self.o_proj(y), self.world)  # row-parallel: sum partial outputs


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size, world):
        super().__init__()
        if intermediate_size % world:
            fail(f"intermediate_size={intermediate_size} is not divisible by the world size "
                 f"{world}; use --nproc_per_node in {divisors(intermediate_size)[:8]}")
        I = intermediate_size // world
        self.world = world
        self.gate_proj = nn.Linear(hidden_size, I, bias=False)  # column-parallel
        self.up_proj = nn.Linear(hidden_size, I, bias=False)    # column-parallel
        self.down_proj = nn.Linear(I, hidden_size, bias=False)  # row-parallel

    def forward(self, x):
        return all_reduce(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)), self.world)


class Block(nn.Module):
    def __init__(self, cfg, world):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg, world, qkv_bias=cfg.qkv_bias, qk_norm=cfg.qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, world)

    def forward(self, x, cos, sin, mask, kv=None, start=0):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Target(nn.Module):
    """The target LLM. Parameter names are exactly the Hugging Face checkpoint keys, so
    loading is a strict key-for-key copy. Embedding and lm_head are replicated; every rank
    ends with identical full logits."""

    def __init__(self, cfg, world=1):
        super().__init__()
        self.cfg, self.world = cfg, world
        self.model = nn.ModuleDict(dict(
            embed_tokens=nn.Embedding(cfg.vocab_size, cfg.hidden_size),
            layers=nn.ModuleList(Block(cfg, world) for _ in range(cfg.n_layers)),
            norm=RMSNorm(cfg.hidden_size, cfg.rms_eps)))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def new_cache(self, length):
        p = self.lm_head.weight
        return new_kv_cache(self.cfg.n_layers, self.cfg.n_kv_heads // self.world,
                            self.cfg.head_dim, length, p.dtype, p.device)

    def forward(self, input_ids, positions=None, mask=None, cache=None, start=0, aux_layers=None):
        """input_ids (B, T) at `positions` (default start..start+T-1), attending to `mask`
        (T, start+T) bool (default causal). With a cache, K/V are written at slots
        start..start+T-1 and the first `start` slots are the prefix.
        Returns logits (B, T, V) and aux (B, T, 3*D): the residual stream entering each
        of `aux_layers` (default 2, L//2, L-3; id L = the final pre-norm state)."""
        B, T = input_ids.shape
        device = input_ids.device
        aux_layers = aux_layers or self.cfg.default_aux_layers
        if positions is None:
            positions = torch.arange(start, start + T, device=device)
        if mask is None:
            mask = causal_mask(T, start, device)
        x = self.model.embed_tokens(input_ids)                              # (B, T, D)
        cos, sin = rope_cos_sin(self.cfg.inv_freq, positions, self.cfg.rope_scale, x.dtype)
        captured = {}
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                captured[i] = x
            kv = None if cache is None else (cache.k[i], cache.v[i])
            x = layer(x, cos, sin, mask, kv, start)
        captured[self.cfg.n_layers] = x
        aux = torch.cat([captured[i] for i in aux_layers], dim=-1)          # (B, T, 3*D)
        return self.lm_head(self.model.norm(x)), aux


def divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


def check_aux_layers(aux_layers, n_layers):
    if len(set(aux_layers)) != 3 or not all(0 <= i <= n_layers for i in aux_layers):
        fail(f"aux layers {tuple(aux_layers)} for a {n_layers}-layer target must be 3 distinct "
             f"ids in 0..{n_layers}; the default (2, L//2, L-3) needs "
             f"num_hidden_layers >= {MIN_LAYERS_FOR_AUX}")


# ----------------------------------------------------------------------------------------
# tensor parallel loading
#
# Which dimension of a checkpoint tensor each rank slices:
#   column-parallel (dim 0, output rows): q/k/v_proj, gate/up_proj (weights and biases)
#   row-parallel    (dim 1, input cols):  o_proj, down_proj
#   replicated:                           embeddings, norms, lm_head


def shard_dim(name):
    if any(p in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return 0
    if any(p in name for p in ("o_proj", "down_proj")):
        return 1
    return None


def checkpoint_files(path):
    """name -> file for the weights of a model dir (single or sharded; safetensors or .bin)."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            weight_map = json.load(open(os.path.join(path, index)))["weight_map"]
            return {k: os.path.join(path, f) for k, f in weight_map.items()}
    for single in ("model.safetensors", "pytorch_model.bin"):
        file = os.path.join(path, single)
        if os.path.isfile(file):
            return {k: file for k in open_checkpoint(file).keys()}
    fail(f"no weights in {path!r}: expected model.safetensors, model.safetensors.index.json, "
         f"pytorch_model.bin or pytorch_model.bin.index.json")


_open_files = {}


def open_checkpoint(file):
    """A handle with .keys() and .get_slice(name); safetensors reads lazily from disk."""
    if file not in _open_files:
        try:
            if file.endswith(".safetensors"):
                from safetensors import safe_open
                _open_files[file] = safe_open(file, framework="pt")
            else:
                _open_files[file] = BinCheckpoint(torch.load(file, map_location="cpu",
                                                             mmap=True, weights_only=True))
        except Exception as e:  # safetensors/pickle raise many types; all mean "corrupt"
            fail(f"cannot read weight file {file!r} ({type(e).__name__}: {e}); "
                 f"the file is corrupt or truncated, re-download or re-save it")
    return _open_files[file]


class BinCheckpoint(NamedTuple):
    state: dict

    def keys(self):
        return self.state.keys()

    def get_slice(self, name):
        return self.state[name]


def read_shard(file, name, dim, rank, world):
    """Read only this rank's slice of one tensor: rows (dim 0) or columns (dim 1)."""
    try:
        t = open_checkpoint(file).get_slice(name)
        if dim is None:
            return t[:]
        n = t.get_shape()[dim] if hasattr(t, "get_shape") else t.shape[dim]
        part = n // world
        lo, hi = rank * part, (rank + 1) * part
        return t[lo:hi] if dim == 0 else t[:, lo:hi]
    except Eagle3Error:
        raise
    except Exception as e:
        fail(f"cannot read {name!r} from {file!r} ({type(e).__name__}: {e}); the file is corrupt")


def load_state(module, path, rank, world, skip=lambda name: False):
    """Strict key-for-key load of a checkpoint dir into `module`, each rank reading only its
    slice. Missing or unexpected keys and wrong shapes are errors that name the key."""
    files = checkpoint_files(path)
    params = dict(module.named_parameters())
    params.update(dict(module.named_buffers()))
    expected = {k for k in params if not skip(k)}
    ignorable = {k for k in files if k.endswith("rotary_emb.inv_freq")}  # old HF buffers
    missing, unexpected = sorted(expected - set(files)), sorted(set(files) - expected - ignorable)
    if missing or unexpected:
        fail(f"checkpoint {path!r} does not match the model: missing keys {missing[:5]}"
             f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
             f"{' ...' if len(unexpected) > 5 else ''}")
    for name in sorted(expected):
        p = params[name]
        t = read_shard(files[name], name, shard_dim(name), rank, world)
        if tuple(t.shape) != tuple(p.shape):
            fail(f"{name!r} in {path!r} has shape {tuple(t.shape)} (this rank's slice), "
                 f"the model expects {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(t.to(p.dtype) if p.is_floating_point() else t)
    _open_files.clear()


def default_dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_target(path, dtype=None, device=None):
    """HF model dir -> Target, sharded over the current TP group (W = 1 without torchrun)."""
    rank, world = world_info()
    cfg = read_target_config(path)
    device = torch.device(device) if device else (
        torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
        else torch.device("cpu"))
    dtype = dtype or default_dtype(device)
    cfg.inv_freq = cfg.inv_freq.to(device)
    with torch.device("meta"):
        target = Target(cfg, world)
    target = target.to_empty(device=device).to(dtype)
    if cfg.tie_embeddings:  # to_empty breaks the tie; restore it
        target.lm_head.weight = target.model.embed_tokens.weight
    load_state(target, path, rank, world,
               skip=lambda name: cfg.tie_embeddings and name == "lm_head.weight")
    return target.eval().requires_grad_(False)


# ----------------------------------------------------------------------------------------
# draft head
#
# One Llama decoder layer whose attention reads the concatenation [embedding ; hidden]
# (2D wide). Its hidden input is either fc(target aux features) for real tokens or its own
# previous pre-norm output for drafted tokens. Pair convention: draft position p holds
# (feature of token p, token p+1) and predicts token p+2.

DRAFT_ROPE_BASE = 10000.0   # draft RoPE base when its config.json has no rope_theta (the
                            # released LLaMA-3.1 drafter), whatever the target uses
DRAFT_ARCHITECTURES = ("LlamaForCausalLMEagle3", "LlamaForCausalLM", "Eagle3LlamaForCausalLM")


@dataclass
class DraftConfig:
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    vocab_size: int            # the target's vocab V: the drafter embeds target ids
    draft_vocab_size: int      # Vd: rows of the draft lm_head
    target_hidden_size: int    # fc maps 3 * target_hidden_size -> hidden_size
    aux_layers: tuple          # target layers whose *input* residual is fused (input ids)
    has_vocab_map: bool        # d2t/t2d buffers present (config has draft_vocab_size)
    inv_freq: torch.Tensor
    rope_scale: float
    raw: dict                  # config.json as read, rewritten on save


def read_draft_config(path_or_dict, target_cfg):
    """Draft config.json (official or SpecForge layout) -> DraftConfig, checked against the
    target it will run with."""
    from transformers import LlamaConfig
    raw = path_or_dict if isinstance(path_or_dict, dict) else json.load(
        open(os.path.join(path_or_dict, "config.json")))
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in DRAFT_ARCHITECTURES:
        fail(f"draft architectures={raw.get('architectures')} is not an EAGLE-3 Llama drafter; "
             f"expected one of {DRAFT_ARCHITECTURES}")
    c = LlamaConfig.from_dict({k: v for k, v in raw.items() if k not in ("architectures",)})
    if "rope_theta" not in raw and "rope_parameters" not in raw:
        c.rope_parameters = {"rope_type": "default", "rope_theta": DRAFT_ROPE_BASE}
    if c.vocab_size != target_cfg.vocab_size:
        fail(f"draft vocab_size={c.vocab_size} != target vocab_size={target_cfg.vocab_size}: "
             f"this drafter was trained for another target")
    target_hidden = raw.get("target_hidden_size", c.hidden_size)
    if target_hidden != target_cfg.hidden_size:
        fail(f"draft expects target hidden size {target_hidden} (fc input 3*{target_hidden}) "
             f"but the target has hidden_size={target_cfg.hidden_size}")
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    # SpecForge writes these as "output of layer k" = input of layer k+1 (our convention)
    aux_layers = tuple(k + 1 for k in ids) if ids else target_cfg.default_aux_layers
    check_aux_layers(aux_layers, target_cfg.n_layers)
    inv_freq, rope_scale = rope_inv_freq(c)
    return DraftConfig(
        hidden_size=c.hidden_size, n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads or c.num_attention_heads,
        head_dim=c.hidden_size // c.num_attention_heads,  # as the official drafter
        intermediate_size=c.intermediate_size, rms_eps=c.rms_norm_eps,
        vocab_size=c.vocab_size, draft_vocab_size=raw.get("draft_vocab_size", c.vocab_size),
        target_hidden_size=target_hidden, aux_layers=aux_layers,
        has_vocab_map="draft_vocab_size" in raw, inv_freq=inv_freq, rope_scale=rope_scale,
        raw=raw)


class DraftLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        D = cfg.hidden_size
        self.hidden_norm = RMSNorm(D, cfg.rms_eps)
        self.input_layernorm = RMSNorm(D, cfg.rms_eps)
        self.self_attn = Attention(cfg, world=1, in_dim=2 * D)  # replicated on every rank
        self.post_attention_layernorm = RMSNorm(D, cfg.rms_eps)
        self.mlp = MLP(D, cfg.intermediate_size, world=1)


class Draft(nn.Module):
    """The EAGLE-3 draft head. Parameter and buffer names are the official checkpoint keys."""

    def __init__(self, cfg, shared_embedding=None):
        super().__init__()
        self.cfg = cfg
        D, Vd = cfg.hidden_size, cfg.draft_vocab_size
        # The target's frozen embedding (shared, never saved) unless the drafter has its own.
        self.own_embedding = shared_embedding is None
        self.embed_tokens = shared_embedding or nn.Embedding(cfg.vocab_size, D)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, D, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(D, cfg.rms_eps)
        self.lm_head = nn.Linear(D, Vd, bias=False)
        if cfg.has_vocab_map:  # target id of draft id i = i + d2t[i]; t2d marks kept target ids
            self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def forward(self, h, tokens, positions, mask, cache=None, start=0):
        """h (B, T, D): fc(target features) or the previous draft output; tokens (B, T) target
        ids. Returns the pre-norm output (B, T, D), which is also the next step's hidden."""
        layer = self.midlayer
        e = self.embed_tokens(tokens).to(h.dtype)
        x = torch.cat([layer.input_layernorm(e), layer.hidden_norm(h)], dim=-1)  # (B, T, 2D)
        cos, sin = rope_cos_sin(self.cfg.inv_freq, positions, self.cfg.rope_scale, h.dtype)
        kv = None if cache is None else (cache.k[0], cache.v[0])
        h = h + layer.self_attn(x, cos, sin, mask, kv, start)  # residual is h, not x
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def logits(self, h):
        return self.lm_head(self.norm(h))  # (.., Vd)

    def to_target_ids(self, draft_ids):
        return draft_ids + self.d2t[draft_ids] if self.cfg.has_vocab_map else draft_ids

    def new_cache(self, length):
        p = self.fc.weight
        return new_kv_cache(1, self.cfg.n_kv_heads, self.cfg.head_dim, length, p.dtype, p.device)


def check_vocab_map(d2t, t2d, V, where):
    """d2t must map draft ids injectively into the target vocab and t2d must mark exactly
    those ids: the official loader's strict=False hides a broken map behind an identity."""
    Vd = d2t.numel()
    target_ids = torch.arange(Vd, device=d2t.device) + d2t
    bad = ((target_ids < 0) | (target_ids >= V)).nonzero()
    if len(bad):
        i = int(bad[0])
        fail(f"{where}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the "
             f"target vocab [0, {V}) ({len(bad)} such ids); the drafter does not fit this target")
    if target_ids.unique().numel() != Vd:
        fail(f"{where}: d2t maps two draft ids to the same target id; it must be injective")
    if t2d.numel() != V or int(t2d.sum()) != Vd or not bool(t2d[target_ids].all()):
        fail(f"{where}: t2d disagrees with d2t: t2d marks {int(t2d.sum())} of {t2d.numel()} "
             f"target ids, d2t maps {Vd} draft ids into a {V}-token vocab; t2d[i + d2t[i]] "
             f"must be True exactly for the mapped ids")


def new_draft(cfg, target, own_embedding=False, dtype=None):
    """An (uninitialised) drafter on the target's device, sharing its embedding."""
    device = target.lm_head.weight.device
    cfg.inv_freq = cfg.inv_freq.to(device)
    with torch.device("meta"):
        draft = Draft(cfg, shared_embedding=None if own_embedding else target.model.embed_tokens)
    for name, child in draft.named_children():   # allocate all but the shared embedding
        if own_embedding or name != "embed_tokens":
            child.to_empty(device=device).to(dtype or target.lm_head.weight.dtype)
    for name, buf in draft.named_buffers(recurse=False):
        setattr(draft, name, torch.empty_like(buf, device=device))
    return draft


def init_draft(draft, seed, std=0.02):
    """Fresh weights from a seeded CPU generator (then copied to the device): norms 1,
    matrices N(0, std). The shared embedding is left alone."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.startswith("embed_tokens") and not draft.own_embedding:
                continue
            w = torch.randn(p.shape, generator=g) * std if p.dim() > 1 else torch.ones(p.shape)
            p.copy_(w)
    return draft


def load_draft(path, target, dtype=None):
    """EAGLE-3 drafter dir (official or SpecForge layout) -> Draft, replicated on every rank.
    Strict: every key present, nothing extra, right shapes, a valid d2t/t2d."""
    cfg = read_draft_config(path, target.cfg)
    files = checkpoint_files(path)
    own = "embed_tokens.weight" in files
    if not own and cfg.hidden_size != target.cfg.hidden_size:
        fail(f"draft hidden_size={cfg.hidden_size} differs from the target's "
             f"{target.cfg.hidden_size}, so it needs its own embed_tokens.weight in {path!r}")
    draft = new_draft(cfg, target, own_embedding=own, dtype=dtype)
    load_state(draft, path, 0, 1, skip=lambda name: not own and name.startswith("embed_tokens"))
    if cfg.has_vocab_map:
        check_vocab_map(draft.d2t, draft.t2d, cfg.vocab_size, path)
    return draft.eval().requires_grad_(False)


def atomic_write(path, write):
    """Write via a temporary name, then rename: an interrupted run never leaves a
    half-written file under the real name."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def save_draft(draft, path):
    """Official/SpecForge layout: config.json + model.safetensors (no frozen embedding)."""
    from safetensors.torch import save_file
    if not is_rank0():
        return
    os.makedirs(path, exist_ok=True)
    cfg = draft.cfg
    state = {k: v.detach().contiguous().cpu() for k, v in draft.state_dict().items()
             if draft.own_embedding or not k.startswith("embed_tokens")}
    raw = dict(cfg.raw, architectures=["LlamaForCausalLMEagle3"], vocab_size=cfg.vocab_size,
               eagle_config=dict(cfg.raw.get("eagle_config") or {}, use_aux_hidden_state=True,
                                 eagle_aux_hidden_state_layer_ids=[i - 1 for i in cfg.aux_layers]))
    if cfg.has_vocab_map:
        raw["draft_vocab_size"] = cfg.draft_vocab_size
    atomic_write(os.path.join(path, "model.safetensors"), lambda f: save_file(state, f))
    atomic_write(os.path.join(path, "config.json"), lambda f: write_json(f, raw))

# ----------------------------------------------------------------------------------------
# draft tree (the official dynamic tree of EAGLE-2/3)
#
# From the root (the token the target just chose) the drafter grows depth+1 levels. Each
# level keeps its K best nodes by cumulative log-probability and expands each into K
# children; *all* K*K children of every level enter a pool of K + depth*K^2 candidates, and
# the total_tokens-1 best of the pool (plus the root) become the tree the target verifies.

TOP_K = 10          # children per expanded node, and nodes expanded per level
DEPTH = 7           # draft forward passes after the first level: depth+1 drafted levels
TOTAL_TOKENS = 60   # tree size the target verifies, root included


class TreeShape(NamedTuple):
    top_k: int = TOP_K
    depth: int = DEPTH
    total_tokens: int = TOTAL_TOKENS


class Tree(NamedTuple):
    tokens: torch.Tensor            # (N,) target ids; node 0 is the root
    parents: torch.Tensor           # (N,) parent node index; -1 for the root
    positions: torch.Tensor         # (N,) depth below the root (root 0)
    mask: torch.Tensor              # (N, N) bool: mask[i, j] = j is i or an ancestor of i
    retrieve_indices: torch.Tensor  # (leaves, max_depth + 1) root-to-leaf node ids, -1 padded


def check_tree_shape(top_k, depth, total_tokens):
    for name, value in (("top_k", top_k), ("depth", depth), ("total_tokens", total_tokens)):
        if not isinstance(value, int) or value < 1:
            fail(f"{name}={value!r} must be a positive integer")
    pool = top_k + depth * top_k ** 2
    if total_tokens - 1 > pool:
        fail(f"total_tokens={total_tokens} cannot be built with top_k={top_k}, depth={depth}: "
             f"at most top_k + depth*top_k^2 + 1 = {pool + 1} nodes exist")
    if total_tokens < 2:
        fail(f"total_tokens={total_tokens} leaves no drafted node; use at least 2")


def topk_first_index(x, k):
    """torch.topk along the last dim with ties broken toward the lower index. It equals
    torch.topk whenever values are distinct; on ties it is reproducible across devices and
    ranks a parent ahead of an equal-scored descendant (parents have lower pool indices)."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def tree_from_parents(tokens, parents):
    """Mask, depths and root-to-leaf paths of a tree whose parents precede their children.
    Worked example, a 5-node tree  0 -> {1, 2}, 1 -> {3}, 3 -> {4}:
        parents   = [-1, 0, 0, 1, 3]
        mask rows = 0:{0} 1:{0,1} 2:{0,2} 3:{0,1,3} 4:{0,1,3,4}   (ancestors-or-self)
        positions = row sums - 1 = [0, 1, 1, 2, 3]
        leaves    = nodes that are nobody's parent = [2, 4]
        retrieve_indices = [[0, 2, -1, -1], [0, 1, 3, 4]]   (rows by leaf index)"""
    tokens, parents = tokens.cpu(), parents.cpu()
    N = len(tokens)
    mask = torch.eye(N, dtype=torch.bool)
    for j, p in enumerate(parents.tolist()[1:], start=1):  # one pass: parents come first
        mask[j] |= mask[p]
    positions = mask.sum(1) - 1
    is_parent = torch.zeros(N, dtype=torch.bool)
    is_parent[parents[1:]] = True
    leaves = (~is_parent).nonzero().flatten()
    retrieve = torch.full((len(leaves), int(positions.max()) + 1), -1, dtype=torch.long)
    for row, leaf in enumerate(leaves.tolist()):
        path = mask[leaf].nonzero().flatten()  # ancestors in index order = root..leaf
        retrieve[row, :len(path)] = path
    return Tree(tokens, parents, positions, mask, retrieve)


def draft_log_probs(draft, h):
    # log-softmax in fp32 whatever the model dtype: fewer exact ties than fp16/bf16 scores
    return torch.log_softmax(draft.logits(h).float(), dim=-1)


def select_tree(pool_scores, pool_tokens, group_parent, root, total_tokens, K):
    """Steps 4-5 of the tree: pick the best total_tokens-1 pool entries and link them.
    Pool layout (flat index s): level 1 at s = 0..K-1; iteration `it` stores child c of its
    r-th input at s = K + it*K^2 + r*K + c. Each run of K siblings is one group g = s // K,
    and group_parent[g] is the pool index of the node they hang under (-1 = the root).
    Example K=2, depth=1: pool = [a, b | a0, a1, b0, b1], group_parent = [-1, 0, 1]
    (a, b the level-1 nodes; a0 = first child of a). Choosing pool {0, 2, 3, 1} -> sorted
    [0, 1, 2, 3] = nodes 1..4 = a, b, a0, a1; parents of a0, a1: pool 0 -> node 1."""
    # 4) select the best; order the tree by flat index (level, parent rank, child rank)
    chosen = topk_first_index(pool_scores, total_tokens - 1)[1].sort().values
    # 5) link: each chosen node's parent pool index -> its node index (root = 0)
    parent_pool = group_parent[chosen // K]
    parents = torch.searchsorted(chosen, parent_pool.clamp(min=0)) + 1
    parents[parent_pool < 0] = 0
    assert bool((chosen[(parents - 1).clamp(min=0)] == parent_pool)[parent_pool >= 0].all()), \
        "a selected node's parent was not selected"  # impossible with first-index ties
    tokens = torch.cat([root.reshape(1), pool_tokens[chosen]])
    return tree_from_parents(tokens, torch.cat([torch.tensor([-1]), parents.cpu()]))


def draft_prefix(draft, cache, start, aux, next_tokens):
    """Run the drafter over real tokens: position start+p gets (target feature of token
    start+p, token start+p+1). Writes cache slots start.. and returns the last output
    (1, D), which predicts the children of the root."""
    m = aux.shape[1]
    positions = torch.arange(start, start + m, device=aux.device)
    h = draft(draft.fc(aux), next_tokens, positions, causal_mask(m, start, aux.device),
              cache, start)
    return h[:, -1]


def grow_tree(draft, cache, n, h_last, root, top_k, depth, total_tokens):
    """Steps 1-3 of the official tree on a draft cache holding n real positions; the tree's
    draft K/V go to slots n.. and are discarded by the next draft_prefix."""
    K, device = top_k, h_last.device
    # 1) level 1: the K best children of the root
    scores, ids = topk_first_index(draft_log_probs(draft, h_last)[0], K)    # (K,)
    tokens = draft.to_target_ids(ids)
    pool_scores, pool_tokens, group_parent = [scores], [tokens], [-1]
    inputs = torch.arange(K, device=device)          # pool indices of this level's nodes
    h = h_last.expand(K, -1)                         # (K, D) the output that drafted them
    tree_mask = torch.eye(K, dtype=torch.bool, device=device)  # ancestors among tree slots
    for it in range(depth):
        # 2) expand: one draft pass over the K nodes of level it+1, all at position n+it,
        #    each seeing the real prefix, its own ancestors and itself
        mask = torch.cat([torch.ones(K, n, dtype=torch.bool, device=device), tree_mask], 1)
        positions = torch.full((K,), n + it, device=device)
        out = draft(h[None], tokens[None], positions, mask, cache, n + it * K)[0]  # (K, D)
        child_logp, child_ids = topk_first_index(draft_log_probs(draft, out), K)  # (K, K)
        cum = scores[:, None] + child_logp           # cumulative log-prob of each child
        pool_scores.append(cum.flatten())
        pool_tokens.append(draft.to_target_ids(child_ids).flatten())
        group_parent.extend(inputs.tolist())         # the K children of input r: group
        if it == depth - 1:
            break
        # 3) rerank: the K best of the K*K children become the next level's nodes
        scores, best = topk_first_index(cum.flatten(), K)
        rows = best // K                             # which input each one hangs under
        inputs = K + it * K * K + best
        tokens, h = pool_tokens[-1][best], out[rows]
        tree_mask = torch.cat([tree_mask[rows], torch.eye(K, dtype=torch.bool, device=device)], 1)
    return select_tree(torch.cat(pool_scores), torch.cat(pool_tokens),
                       torch.tensor(group_parent, device=device), root, total_tokens, K)


@torch.no_grad()
def draft_tree(draft, aux, input_ids, top_k=TOP_K, depth=DEPTH, total_tokens=TOTAL_TOKENS):
    """One round of drafting from scratch, as the official `topK_genrate`: aux (1, T, 3*D_t)
    are the target features of tokens 0..T-1, input_ids (1, T+1) those tokens plus the root."""
    check_tree_shape(top_k, depth, total_tokens)
    T = aux.shape[1]
    if input_ids.shape != (1, T + 1):
        fail(f"input_ids has shape {tuple(input_ids.shape)}; with aux of {T} positions it must "
             f"be (1, {T + 1}): the {T} featured tokens plus the root")
    cache = draft.new_cache(T + top_k * depth)
    h_last = draft_prefix(draft, cache, 0, aux, input_ids[:, 1:])
    return grow_tree(draft, cache, T, h_last, input_ids[0, -1], top_k, depth, total_tokens)

# ----------------------------------------------------------------------------------------
# verify and accept
#
# The target scores the whole tree in one forward pass: node i sits at position n + depth(i)
# and attends to the accepted prefix plus its own ancestors. Acceptance walks down from the
# root; everything random is drawn from one seeded generator in a documented order, and the
# uniforms are returned so another implementation can replay the same coins.


class Sampling(NamedTuple):
    temperature: float = 0.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    @property
    def greedy(self):
        return self.temperature == 0


def check_sampling(s):
    if not isinstance(s.temperature, (int, float)) or s.temperature < 0:
        fail(f"temperature={s.temperature!r} must be >= 0 (0 = greedy)")
    if not 0 < s.top_p <= 1:
        fail(f"top_p={s.top_p!r} must be in (0, 1] (1 = off)")
    if not isinstance(s.top_k, int) or s.top_k < 0:
        fail(f"top_k={s.top_k!r} must be an integer >= 0 (0 = off)")


def target_probs(logits, s):
    """Warped distribution with transformers' semantics, in float64: temperature, then
    top-k (keep every token >= the k-th largest logit), then top-p (drop the low tokens
    whose cumulative probability stays <= 1 - top_p; the top token always survives)."""
    x = logits.double() / s.temperature
    if s.top_k > 0:
        kth = torch.topk(x, min(s.top_k, x.shape[-1])).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if s.top_p < 1:
        sorted_x, order = torch.sort(x, stable=True)                    # ascending
        drop = sorted_x.softmax(-1).cumsum(-1) <= 1 - s.top_p
        drop[..., -1] = False
        x = x.masked_fill(drop.scatter(-1, order, drop), -math.inf)
    return x.softmax(-1)


def sample_inverse_cdf(p, u):
    """The token whose CDF interval [cdf(i-1), cdf(i)) contains u * sum(p): one uniform per
    token, so replaying the uniform replays the token. Zero-probability tokens never win."""
    cdf = p.double().cumsum(-1)
    i = int(torch.searchsorted(cdf, u * cdf[-1:], right=True))
    return min(i, int(p.nonzero().max()))  # u * sum rounding up to the total: last live token


def uniform_stream(generator):
    """Uniforms in [0, 1) drawn one at a time (float64) from a seeded CPU generator."""
    while True:
        yield float(torch.rand((), generator=generator, dtype=torch.float64))


class Acceptance(NamedTuple):
    path: torch.Tensor   # (a+1,) node indices, root first
    accepted: int        # a = drafted tokens accepted
    bonus: int           # the target's own next token after the path
    uniforms: list       # the uniforms this round used, in order (empty when greedy)


@torch.no_grad()
def verify_tree(target, cache, n, tree, aux_layers):
    """Target forward of the N tree nodes at cache slots n..n+N-1 -> logits (N, V), aux."""
    device = cache.k.device
    N = len(tree.tokens)
    mask = torch.cat([torch.ones(N, n, dtype=torch.bool, device=device), tree.mask.to(device)], 1)
    logits, aux = target(tree.tokens[None].to(device), (n + tree.positions).to(device), mask,
                         cache, n, aux_layers)
    return logits[0], aux[0]


def accept_greedy(logits, tree):
    """Longest root-to-leaf prefix whose every drafted token equals the target's argmax at
    its parent; the first maximal row of retrieve_indices wins; bonus = the argmax after the
    last accepted node."""
    R = tree.retrieve_indices                              # (leaves, depth+1)
    predicted = logits.argmax(-1).cpu()                    # (N,) first maximal index
    node, child = R[:, :-1].clamp(min=0), R[:, 1:].clamp(min=0)
    match = (tree.tokens[child] == predicted[node]) & (R[:, 1:] >= 0)
    accepted = match.long().cumprod(1).sum(1)              # (leaves,)
    best = int(accepted.argmax())
    a = int(accepted[best])
    path = R[best, :a + 1]
    return Acceptance(path, a, int(predicted[path[-1]]), [])


def children_of(parents):
    kids = [[] for _ in parents]
    for child, parent in enumerate(parents.tolist()[1:], start=1):
        kids[parent].append(child)  # ascending node index = descending draft rank
    return kids


def accept_sampled(logits, tree, uniforms, sampling):
    """The official recursive scheme for deterministic (top-k) drafts, i.e. q = 1.
    Order of the random draws (the replay contract):
      at the current node, for each child in ascending node index: one uniform u;
        accept the child's token x iff u <= p(x), and move to it (p = its target dist.);
        otherwise set p(x) = 0, renormalise p, and try the next child;
      when no child is accepted (or the node is a leaf): one uniform for the bonus token,
        drawn from p by inverse CDF (the residual if children were rejected here).
    Lossless: each step emits x with probability p(x) and otherwise samples the rest of p."""
    kids = children_of(tree.parents)
    node, path, used = 0, [0], []
    p = target_probs(logits[0], sampling)
    while True:
        for child in kids[node]:
            u = next(uniforms)
            used.append(u)
            x = int(tree.tokens[child])
            if u <= p[x]:
                break
            p[x] = 0
            p = p / p.sum()
        else:
            break                         # every child rejected, or a leaf
        node = child
        path.append(node)
        p = target_probs(logits[node], sampling)
    u = next(uniforms)
    used.append(u)
    return Acceptance(torch.tensor(path), len(path) - 1, sample_inverse_cdf(p, u), used)


def accept_chain(logits, drafts, q, uniforms, sampling):
    """Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for a chain
    of k drafts sampled from q (k, V). Draws after the k drafting uniforms: for each draft
    i one uniform u, accept iff u * q_i(x) <= p_i(x); on the first rejection one uniform
    for the token from norm(max(0, p_i - q_i)); if all pass, one uniform for the bonus
    from p_k."""
    used = []
    for i, x in enumerate(drafts.tolist()):
        p = target_probs(logits[i], sampling)
        u = next(uniforms)
        used.append(u)
        if u * q[i, x] <= p[x]:
            continue
        residual = (p - q[i]).clamp(min=0)
        u = next(uniforms)
        used.append(u)
        bonus = sample_inverse_cdf(residual if residual.sum() > 0 else p, u)
        return Acceptance(torch.arange(i + 1), i, bonus, used)
    u = next(uniforms)
    used.append(u)
    k = len(drafts)
    return Acceptance(torch.arange(k + 1), k, sample_inverse_cdf(
        target_probs(logits[k], sampling), u), used)


def draft_chain(draft, cache, n, h_last, root, length, uniforms, sampling):
    """Sample a chain of drafts from the drafter's own warped distribution q, one uniform
    per draft (inverse CDF). Returns the chain as a Tree, q over the target vocab (k, V)
    and the uniforms used."""
    device, V = h_last.device, draft.cfg.vocab_size
    tokens, q_rows, used = [], [], []
    h = h_last[None]                                                # (1, 1, D)
    for i in range(length):
        q_draft = target_probs(draft.logits(h[0, -1]), sampling)    # (Vd,)
        u = next(uniforms)
        used.append(u)
        token = draft.to_target_ids(torch.tensor([sample_inverse_cdf(q_draft, u)], device=device))
        q = torch.zeros(V, dtype=torch.float64, device=device)
        q[draft.to_target_ids(torch.arange(len(q_draft), device=device))] = q_draft
        tokens.append(token)
        q_rows.append(q)
        if i < length - 1:  # pair (output that drafted it, token) at position n+i
            positions = torch.tensor([n + i], device=device)
            h = draft(h[:, -1:], token[None], positions, causal_mask(1, n + i, device), cache, n + i)
    chain = torch.cat([root.reshape(1)] + tokens)
    tree = tree_from_parents(chain, torch.arange(-1, length))
    return tree, torch.stack(q_rows), used


def decide(acceptance, max_nodes, device):
    """Rank 0's acceptance on every rank, so all ranks commit the same path (ranks
    deciding independently is how TP engines have deadlocked or diverged)."""
    packed = torch.full((max_nodes + 2,), -1, dtype=torch.long, device=device)
    packed[0], packed[1] = acceptance.accepted, acceptance.bonus
    packed[2:3 + acceptance.accepted] = acceptance.path
    packed = broadcast0(packed).cpu()
    a = int(packed[0])
    return Acceptance(packed[2:3 + a], a, int(packed[1]), acceptance.uniforms)

# ----------------------------------------------------------------------------------------
# generate
#
# Output contract (deliberately stricter than the official loop): never more than
# max_new_tokens, nothing after the first EOS, and the bonus token is part of the output.

SCHEMES = ("tree", "chain")  # official dynamic tree (greedy or q=1 sampling) | sampled chain


def check_generation_args(input_ids, max_new_tokens, capacity, reserve=0):
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        fail(f"input_ids must have shape (1, T) (batch size 1), got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        fail("the prompt is empty: input_ids has shape (1, 0); give at least one token")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        fail(f"max_new_tokens={max_new_tokens!r} must be a positive integer")
    need = input_ids.shape[1] + max_new_tokens + reserve
    if need > capacity:
        fail(f"prompt ({input_ids.shape[1]} tokens) + max_new_tokens ({max_new_tokens})"
             f"{f' + tree ({reserve})' if reserve else ''} = {need} exceeds the cache length "
             f"{capacity} (max_position_embeddings or sliding window); shorten one of them")


def is_eos(token, eos_token_id):
    if eos_token_id is None:
        return False
    ids = eos_token_id if isinstance(eos_token_id, (list, tuple, set)) else [eos_token_id]
    return int(token) in ids


def emit(out, tokens, max_new_tokens, eos_token_id):
    """Append tokens to out up to the budget or the first EOS; True when generation ends."""
    for t in tokens:
        out.append(int(t))
        if len(out) == max_new_tokens or is_eos(t, eos_token_id):
            return True
    return False


def next_token(logits, sampling, uniforms):
    """Greedy argmax, or one uniform -> inverse CDF of the warped distribution. The token
    is rank 0's on every rank. Returns (token, uniforms used)."""
    if sampling.greedy:
        token, used = int(logits.argmax()), []
    else:
        used = [next(uniforms)]
        token = sample_inverse_cdf(target_probs(logits, sampling), used[0])
    return int(broadcast0(torch.tensor([token], device=logits.device))), used


@torch.no_grad()
def autoregressive_generate(target, input_ids, max_new_tokens, sampling, seed, eos_token_id):
    """Plain decoding with a KV cache: one target forward per token."""
    check_sampling(sampling)
    check_generation_args(input_ids, max_new_tokens, target.cfg.max_positions)
    uniforms = uniform_stream(torch.Generator().manual_seed(seed))
    n = input_ids.shape[1]
    cache = target.new_cache(n + max_new_tokens)
    logits, _ = target(input_ids, cache=cache)
    out = []
    while True:
        token, _ = next_token(logits[0, -1], sampling, uniforms)
        if emit(out, [token], max_new_tokens, eos_token_id):
            return torch.tensor(out)
        logits, _ = target(torch.tensor([[token]], device=input_ids.device), cache=cache, start=n)
        n += 1


def greedy_generate(target, input_ids, max_new_tokens, eos_token_id=None):
    """Argmax decoding: the baseline, and the reference greedy speculation must equal."""
    return autoregressive_generate(target, input_ids, max_new_tokens, Sampling(), 0, eos_token_id)


def sample_generate(target, input_ids, max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                    seed=0, eos_token_id=None):
    """Plain sampling: one uniform per token, inverse CDF of the warped distribution."""
    return autoregressive_generate(target, input_ids, max_new_tokens,
                                   Sampling(temperature, top_k, top_p), seed, eos_token_id)


class Round(NamedTuple):
    tree: Tree            # what the target verified (a chain is a tree with one branch)
    path: torch.Tensor    # accepted node indices, root first
    accepted: int         # drafted tokens accepted
    bonus: int            # the target's token after the path (next round's root)
    uniforms: list        # this round's uniforms in draw order (sampling only)


class SpecResult(NamedTuple):
    tokens: torch.Tensor  # (new tokens,) the output, root of round 1 first
    accept_lengths: list  # per round: accepted + 1 (the bonus); tau = their mean
    rounds: list          # list[Round], the per-round trace
    first_uniforms: list  # the uniform that sampled the first token (sampling only)


@torch.no_grad()
def speculative_generate(target, draft, input_ids, max_new_tokens, temperature=0.0, top_p=1.0,
                         top_k=0, tree=TreeShape(), seed=0, eos_token_id=None, scheme="tree"):
    """EAGLE-3 speculative decoding. Greedy output equals greedy_generate token for token;
    sampled output has exactly the distribution of sample_generate."""
    sampling = Sampling(temperature, top_k, top_p)
    check_sampling(sampling)
    tree = TreeShape(*tree)
    check_tree_shape(*tree)
    if scheme not in SCHEMES or (scheme == "chain" and sampling.greedy):
        fail(f"scheme={scheme!r} must be one of {SCHEMES}; 'chain' samples drafts and needs "
             f"temperature > 0 (greedy chains are trees with top_k=1)")
    N = tree.total_tokens if scheme == "tree" else tree.depth + 2
    check_generation_args(input_ids, max_new_tokens, target.cfg.max_positions, reserve=N)
    device, aux_layers = input_ids.device, draft.cfg.aux_layers
    uniforms = uniform_stream(torch.Generator().manual_seed(seed))
    n = input_ids.shape[1]
    target_cache = target.new_cache(n + max_new_tokens + N)
    draft_cache = draft.new_cache(n + max_new_tokens + tree.top_k * tree.depth)  # tree slots
    # prefill: the target's first token is the root of round 1
    logits, aux = target(input_ids, cache=target_cache, aux_layers=aux_layers)
    root, first_uniforms = next_token(logits[0, -1], sampling, uniforms)
    out, rounds = [], []
    done = emit(out, [root], max_new_tokens, eos_token_id)
    next_tokens = torch.cat([input_ids[0, 1:], torch.tensor([root], device=device)])
    h_last = draft_prefix(draft, draft_cache, 0, aux, next_tokens[None])
    while not done:
        root_t = torch.tensor(root, device=device)
        if scheme == "tree":
            t = grow_tree(draft, draft_cache, n, h_last, root_t, *tree)
        else:
            t, q, drafting_uniforms = draft_chain(draft, draft_cache, n, h_last, root_t,
                                                  tree.depth + 1, uniforms, sampling)
        logits, aux = verify_tree(target, target_cache, n, t, aux_layers)
        if sampling.greedy:
            acc = accept_greedy(logits, t)
        elif scheme == "tree":
            acc = accept_sampled(logits, t, uniforms, sampling)
        else:
            acc = accept_chain(logits, t.tokens[1:], q, uniforms, sampling)
            acc = acc._replace(uniforms=drafting_uniforms + acc.uniforms)
        acc = decide(acc, N, device)
        rounds.append(Round(t, acc.path, acc.accepted, acc.bonus, acc.uniforms))
        new_tokens = t.tokens[acc.path[1:]].tolist() + [acc.bonus]
        done = emit(out, new_tokens, max_new_tokens, eos_token_id)
        if done:
            break
        # commit: keep the accepted nodes' K/V; re-encode them in the drafter with the
        # target's features (pair: feature of node i, token of node i+1 / the bonus)
        n_next = commit(target_cache, n, acc.path.to(device))
        h_last = draft_prefix(draft, draft_cache, n, aux[acc.path.to(device)][None],
                              torch.tensor([new_tokens], device=device))
        n, root = n_next, acc.bonus
    return SpecResult(torch.tensor(out), [r.accepted + 1 for r in rounds], rounds, first_uniforms)

