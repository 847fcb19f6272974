"""Memory of a backward pass per variant: what autograd saves between forward and backward,
and the peak of each pass.

Saved bytes are counted with torch.autograd.graph.saved_tensors_hooks: every tensor the
forward saves for backward passes through the pack hook, and the distinct storages among them
are summed (an input saved as is counts: the backward keeps it alive). Peaks are read by
fusionlab/measure/peak_memory.py (the CPU profiler's allocation events; CUDA's allocator
statistics): the most bytes live beyond those live when the pass began."""

from __future__ import annotations

import torch

from fusionlab.measure.passes import PassCall
from fusionlab.measure.peak_memory import memory_use
from fusionlab.op import Inputs
from fusionlab.records import PassMemory


def pass_memory(call: PassCall, inputs: Inputs, device: torch.device) -> PassMemory:
    """One untimed forward and backward of `call`'s variant on `inputs` (the pass op's)."""
    count = call.forward_inputs
    forward, upstream = tuple(inputs[:count]), tuple(inputs[count:])
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    prepared = call.leaves_of(forward)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward_use = memory_use(lambda: call.run_forward(prepared), device)
    prepared.outputs = call.run_forward(prepared)
    backward_use = memory_use(
        lambda: torch.autograd.grad(prepared.outputs, prepared.leaves, upstream), device
    )
    return PassMemory(sum(storages.values()), forward_use.peak, backward_use.peak)
