"""vLLM's rejection step held against the EAGLE-3 reference's rule, target-free
(written by eagle3_engines.py engine-check): target logits, argmax drafts, the temperature,
uniforms and Exp(1) noise in, tokens out, as vLLM's RejectionSampler runs it after the bonus
token (warp, then rejection_sample). CASE["expected"]: the tokens the rule gives (eagle3-ref).
Run with vLLM's python; exit 1 where vLLM's tokens differ. This file is the template
engine-check fills in: its CASE line is replaced by the crafted case (run as is, it takes the
case as a JSON string argument)."""
import json
import sys

import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()   # as vLLM's worker does at start-up
import vllm.v1.sample.rejection_sampler as rs
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

CASE = json.loads(sys.argv[1])
B = len(CASE["drafts"])
meta = SamplingMetadata(
    temperature=torch.full((B,), CASE["temperature"]), all_greedy=False, all_random=True,
    top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
    prompt_token_ids=None, frequency_penalties=torch.zeros(B), presence_penalties=torch.zeros(B),
    repetition_penalties=torch.ones(B), output_token_ids=[[] for _ in range(B)],
    allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
spec = SpecDecodeMetadata.make_dummy(CASE["drafts"], torch.device("cpu"))
rs.generate_uniform_probs = lambda *a, **kw: torch.tensor(CASE["uniforms"], dtype=torch.float64)
recover = rs._sample_recovered_tokens


def fed_noise(out, cu, drafts, q, p, inv_q, **kw):   # the recovered token's Exp(1) noise
    inv_q.copy_(1 / torch.tensor(CASE["exponentials"]))
    return recover(out, cu, drafts, q, p, inv_q, **kw)


rs._sample_recovered_tokens = fed_noise
logits = rs.apply_sampling_constraints(torch.tensor(CASE["logits"]), spec.cu_num_draft_tokens,
                                       meta)
out = rs.rejection_sample(spec.draft_token_ids, spec.num_draft_tokens, spec.max_spec_len,
                          spec.cu_num_draft_tokens, None, logits,
                          torch.tensor(CASE["bonus"])[:, None], meta)
tokens = rs.RejectionSampler.parse_output(out, logits.shape[-1])[0]
for b, (got, want) in enumerate(zip(tokens, CASE["expected"])):
    print(f"request {b}: vLLM {got}, the rule {want}: {'agree' if got == want else 'DIFFER'}")
print(f"{sum(map(list.__eq__, tokens, CASE['expected']))} of {B} requests agree")
sys.exit(int(tokens != CASE["expected"]))
