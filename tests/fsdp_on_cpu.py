"""Run a script with accelerate's FSDP2 code path on CPU processes (a test helper, not a test).

    torchrun --standalone --nproc_per_node 2 tests/fsdp_on_cpu.py scripts/finetune.py --use-cpu ...

with the environment `accelerate launch --config_file examples/accelerate_fsdp.yaml` gives its processes. accelerate
only enables FSDP on accelerators (on CPU processes it falls back to DDP); this flips the accelerator state to FSDP
right after `Accelerator.__init__`, so `Trainer` and accelerate then run their real FSDP2 code on gloo: rank 0 alone
loading the weights, activation checkpointing, `fully_shard` of the configured layers, the sharded optimizer, the
full-state-dict saves and the resume. Nothing here shards anything itself.
"""

import runpy
import sys

import accelerate
from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin


_accelerator_init = accelerate.Accelerator.__init__


def _fsdp_accelerator_init(self, *args, **kwargs):
    _accelerator_init(self, *args, **kwargs)
    # Both shared states: AcceleratorState copies PartialState's when it is (re)built.
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    self.state.distributed_type = DistributedType.FSDP
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* environment
    if self.state.mixed_precision != "no":
        plugin.set_mixed_precision(self.state.mixed_precision)  # as AcceleratorState does for FSDP
    self.state.fsdp_plugin = plugin


if __name__ == "__main__":
    accelerate.Accelerator.__init__ = _fsdp_accelerator_init
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
