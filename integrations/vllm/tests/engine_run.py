"""One vLLM engine run, in a process of its own: ``python engine_run.py JOB.json`` writes ``JOB.json.out``.

The job names the model directory, the prompts (token ids, or ``{"prompt_token_ids": [...], "cache_salt":
"..."}``) and the connector's extra config (none: vLLM alone); optionally ``batch`` (every prompt in one
``generate`` call, so they run together, instead of one at a time), ``num_gpu_blocks_override`` (vLLM's KV
space in blocks), ``tensor_parallel_size``, ``lora`` (``{"name": adapter directory}``: LoRA on, and a
prompt ``{"lora": "name", ...}`` is served with that adapter) and ``remove_before`` (``{"i": [file, ...]}``:
files removed, under the running engine, before prompt ``i`` is served; each must exist). Before each
``generate`` call the run writes ``engine_run: prompt i`` to stdout, where vLLM's processes log, so the log
can be cut by prompt. The result
holds, per prompt, the greedy tokens, their top logprobs and how many prompt tokens vLLM did not compute
(``num_cached_tokens``; vLLM's own prefix cache is off, so these are the tokens the connector loaded), plus
the engine's start and generation times and how many times vLLM preempted a request.

The engine is shut down before the run returns, giving its processes ``KVMEM_TEST_SHUTDOWN_GRACE_S`` seconds
(default 120) to exit: the connector's workers log their counts as they shut down, and vLLM's own 5 s grace,
at interpreter exit, may kill them first on a busy machine.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

TOP_LOGPROBS = 5


def run(job: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    transfer = None
    if job["extra_config"] is not None:
        transfer = KVTransferConfig(
            kv_connector="KVMemConnector",
            kv_connector_module_path="kvmem_vllm",
            kv_role=job.get("role", "kv_both"),
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=job["extra_config"],
        )
    start = time.perf_counter()
    llm = LLM(
        model=job["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=job["max_model_len"],
        enable_prefix_caching=False,
        kv_transfer_config=transfer,
        num_gpu_blocks_override=job.get("num_gpu_blocks_override"),
        tensor_parallel_size=job.get("tensor_parallel_size", 1),
        **({"enable_lora": True, "max_lora_rank": 8, "max_loras": 2} if job.get("lora") else {}),
        disable_log_stats=False,  # NOTE: for vllm:num_preemptions
        seed=0,
    )
    started = time.perf_counter() - start
    params = SamplingParams(
        temperature=0.0, max_tokens=job["max_tokens"], logprobs=TOP_LOGPROBS, detokenize=False, ignore_eos=True
    )
    adapters = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(job.get("lora", {}).items())}
    loras = [adapters[p["lora"]] if isinstance(p, dict) and "lora" in p else None for p in job["prompts"]]
    prompts = [
        TokensPrompt(**{k: v for k, v in p.items() if k != "lora"})
        if isinstance(p, dict)
        else TokensPrompt(prompt_token_ids=p)
        for p in job["prompts"]
    ]
    # NOTE: one prompt at a time unless batched: a later prompt may reuse an earlier one's chunks
    groups = [list(zip(prompts, loras))] if job.get("batch") else [[(p, lora)] for p, lora in zip(prompts, loras)]
    remove = job.get("remove_before", {})
    outs = []
    generate_s = []
    for i, group in enumerate(groups):
        for file in remove.get(str(i), ()):
            Path(file).unlink()  # NOTE: FileNotFoundError fails the run: the test named a file that is not there
        print(f"engine_run: prompt {i}", flush=True)  # NOTE: on stdout, where vLLM's processes log
        t = time.perf_counter()
        outs += llm.generate([p for p, _ in group], params, use_tqdm=False, lora_request=[lora for _, lora in group])
        generate_s.append(time.perf_counter() - t)
    results = [
        {
            "tokens": list(out.outputs[0].token_ids),
            "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in out.outputs[0].logprobs or []],
            "cached": out.num_cached_tokens,
        }
        for out in outs
    ]
    preemptions = sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
    llm.llm_engine.engine_core.shutdown(timeout=float(os.environ.get("KVMEM_TEST_SHUTDOWN_GRACE_S", "120")))
    return {"start_s": started, "generate_s": generate_s, "prompts": results, "preemptions": preemptions}


if __name__ == "__main__":  # NOTE: vLLM spawns its workers: nothing may run at import
    path = Path(sys.argv[1])
    result = run(json.loads(path.read_text()))
    Path(f"{path}.out").write_text(json.dumps(result))
