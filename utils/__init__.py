"""The course's shared helpers: one small module per concern.

- ``env``     device choice, capabilities, the environment report, clock / power / PCIe readings
- ``bench``   how the course measures: one timing, the one comparison (alternating rounds, three verdicts), a
  sweep over sizes, recording inside the measuring call, and the peaks measured on this machine
- ``datasheets`` vendor peak rates, and which sheet describes this GPU
- ``profile`` torch.profiler: a step's kernels, busy vs idle GPU time, top kernels, Perfetto traces; after a
  profile, no timing in the same process
- ``compile_cache`` cold and warm torch.compile caches: a fresh cache directory, graph-cache counts
- ``compile`` torch.compile measured: generated kernels, first calls from cold caches, break-even, checks against eager
- ``extension`` building the C++/CUDA extensions of ``csrc/`` (imported by the operators that need it)
- ``memory``  allocated / reserved / peak memory, a block's peak, what autograd keeps for backward, byte formatting
- ``memory_snapshot`` CUDA memory snapshots: recorded allocations, the timeline, who holds the peak
- ``memory_calculator`` a training step's memory predicted from sizes (optimizer state, activations)
- ``checkpointing`` activation checkpointing, full or selective, with what backward recomputes counted
- ``out_of_memory`` out-of-memory errors caught and released; the largest batch that fits
- ``allocator`` the CUDA caching allocator: fragmentation, and which setting it really uses
- ``data``    MNIST (local → download → bundled sample), GPU-resident batches, synthetic data
- ``models``  the small models the notebooks train
- ``number_formats`` how fp32, TF32, fp16, bf16 and fp8 store a value: rounding, overflow, underflow
- ``amp``     notebook 03's checks: what fp16 loses, do precisions train alike, the GradScaler's cost and loop rules
- ``gpt2``    a readable GPT-2 (124M) with a static KV cache; real weights from the hub when online
- ``gpt2_fused`` GPT-2's decode step in five Triton kernels per layer (``import utils.gpt2_fused``: it imports
  triton, which on a CPU must follow TRITON_INTERPRET=1)
- ``plot``    tables and the few chart shapes
- ``explore`` controls (ipywidgets) for "a function of a few parameters → a table or plot", with a static result
- ``results`` headline figures that the reference run collects
- ``train``   the training steps the notebooks measure (autocast, GradScaler, clipping; a CUDA-graph step)
- ``playbook`` the performance tips of notebook 07: findings and their table, the profiler's diagnosis
- ``distributed`` torchrun launches streamed into a notebook, process groups (NCCL / gloo), collective timing
- ``exercises`` the self-checks of the notebooks' exercises
- ``input_pipeline`` JPEG decoding and augmentation on CPU workers or the GPU (``import utils.input_pipeline``:
  it loads torchvision's codecs, which the other notebooks do not need)
- ``isolate`` steps that may crash or hang run in child processes with deadlines; crash traces and per-section
  timing for the rest of a run (``import utils.isolate``: notebook 08's prototype steps)
- ``inference`` what notebooks 08 and 08b measure around serving GPT-2: child deadlines by cores, the AOTInductor
  gate and report, the Hugging Face child's comparison, the batch sweep (``import utils.inference``)
- ``quantization`` notebook 08c's measuring: GPT-2 sizes by device, weight bytes, the decode sweep bf16 against int8,
  logits against fp32 (a broken quantization raises), perplexity, torchao's gate, fp8 recipes and sweep
  (``import utils.quantization``)
- ``benchmarks`` the guide's benchmark table (notebooks 09 and 09b): its rows, checks against fp32, the compile row,
  attention in a compiled graph, cross-checks between notebooks (``import utils.benchmarks``)
"""

from utils import (
    allocator,
    amp,
    bench,
    checkpointing,
    compile,
    compile_cache,
    data,
    datasheets,
    distributed,
    env,
    exercises,
    explore,
    gpt2,
    memory,
    memory_calculator,
    memory_snapshot,
    models,
    number_formats,
    out_of_memory,
    playbook,
    plot,
    profile,
    results,
    train,
)

__all__ = ["allocator", "amp", "bench", "checkpointing", "compile", "compile_cache", "data", "datasheets",
           "distributed", "env", "exercises", "explore", "gpt2", "memory", "memory_calculator", "memory_snapshot",
           "models", "number_formats", "out_of_memory", "playbook", "plot", "profile", "results", "train"]
