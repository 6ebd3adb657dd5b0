"""pdflash.offload: run a Mixture-of-Experts checkpoint whose experts do not fit on the device.

Checkpoints
    Checkpoint(path)                      validate a Hugging Face checkpoint directory (config.json,
                                          model.safetensors or shards + index); PdflashError otherwise
    ModelPreset.from_name("tiny" | "gpt-oss-20b")
    write_checkpoint(out_dir, preset, *, mxfp4=False, seed=0, dtype="bfloat16", max_shard_bytes=4 GiB,
                     progress=False) -> Path       seeded synthetic checkpoint in the real format
    dequantize(blocks, scales, dtype) -> weight [..., in, out]; quantize(weight) -> (blocks, scales)

Model families
    A family adapter (gpt_oss.GptOssFamily) knows the tensor names, the expert layout and maths,
    and how to build the library's own model with its experts swapped; family.find_family(config).
"""

from pdflash.offload.checkpoint import Checkpoint
from pdflash.offload.config import PRESETS, ModelPreset
from pdflash.offload.mxfp4 import dequantize, quantize
from pdflash.offload.synthetic import write_checkpoint

__all__ = ["Checkpoint", "ModelPreset", "PRESETS", "dequantize", "quantize", "write_checkpoint"]
