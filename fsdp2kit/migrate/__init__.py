"""Coming from Accelerate, FSDP1 or DeepSpeed: their configs converted, their checkpoints loaded."""

from fsdp2kit.migrate.conversion import ConfigConversionError, Conversion, Entry
from fsdp2kit.migrate.convert import convert_config
from fsdp2kit.migrate.fsdp1_checkpoint import load_fsdp1_checkpoint
from fsdp2kit.migrate.full_state import ImportResult, load_full_state_dict

__all__ = [
    "ConfigConversionError",
    "Conversion",
    "Entry",
    "ImportResult",
    "convert_config",
    "load_fsdp1_checkpoint",
    "load_full_state_dict",
]
