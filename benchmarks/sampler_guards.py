"""A sampler from an earlier commit vs now, interleaved, on SmolLM2-sized logits ([B, 49152] fp32), per step.

Issue 15's guards (the finite-logits pass, the sampled-id check):

    git show 7abd31f:engine/sampler.py > /tmp/sampler_before.py
    .venv/bin/python benchmarks/sampler_guards.py /tmp/sampler_before.py

Issue 16's Gumbel draw for seeded rows (the "seeded" cases; before: inverse CDF for every row):

    git show 6252d2e:engine/sampler.py > /tmp/sampler_before.py
    .venv/bin/python benchmarks/sampler_guards.py /tmp/sampler_before.py

The CPU's sampling in C (csrc/sample.c: every case; before: the torch twins, the sampler at d638cda):

    git show d638cda:engine/sampler.py > /tmp/sampler_before.py
    .venv/bin/python benchmarks/sampler_guards.py /tmp/sampler_before.py
"""

import importlib.util
import statistics
import sys
import time

import torch

from engine.sampler import Sampler as After
from engine.sampler import SamplingRow
from engine.sampling_params import SamplingParams

spec = importlib.util.spec_from_file_location("sampler_before", sys.argv[1])
before = importlib.util.module_from_spec(spec)
sys.modules["sampler_before"] = before
spec.loader.exec_module(before)
torch.set_num_threads(2)
print("| batch | params | before ms (median) | after ms (median) | after/before min / median / max |")
print("|---:|---|---:|---:|---|")
g = torch.Generator().manual_seed(0)
CASES = {
    "greedy": lambda i: SamplingParams(temperature=0),
    "top-p/top-k/penalty": lambda i: SamplingParams(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1,
                                                    seed=i),
    "seeded, full vocabulary": lambda i: SamplingParams(temperature=0.8, seed=i),
    "unseeded, full vocabulary": lambda i: SamplingParams(temperature=0.8),
    "unseeded, logprobs 5": lambda i: SamplingParams(temperature=0.8, logprobs=5),
}
for batch, kind in ((1, "greedy"), (32, "greedy"), (32, "top-p/top-k/penalty"), (1, "seeded, full vocabulary"),
                    (32, "seeded, full vocabulary"), (32, "unseeded, full vocabulary"), (1, "unseeded, logprobs 5"),
                    (32, "unseeded, logprobs 5")):
    logits = torch.randn(batch, 49152, generator=g) * 4
    params = [CASES[kind](i) for i in range(batch)]
    rows = [SamplingRow(p, [1, 2, 3], [4, 5]) for p in params]
    a, b = After(seed=0), before.Sampler(seed=0)
    for s in (a, b):
        s.sample(logits, rows)
    ta, tb = [], []
    for _ in range(30):
        start = time.perf_counter()
        b.sample(logits, rows)
        tb.append(time.perf_counter() - start)
        start = time.perf_counter()
        a.sample(logits, rows)
        ta.append(time.perf_counter() - start)
    ratio = [x / y for x, y in zip(ta, tb)]
    print(f"| {batch} | {kind} | {statistics.median(tb)*1e3:.3f} | {statistics.median(ta)*1e3:.3f} | "
          f"{min(ratio):.2f} / {statistics.median(ratio):.2f} / {max(ratio):.2f} |")
