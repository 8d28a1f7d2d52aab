"""The attributes fsdp2kit leaves on modules and tensors it changed, each named once: later steps read
what earlier ones left (prefetch needs the block order shard_model recorded)."""

# On a block: the activation-checkpointing mode applied to it ("full", "selective", "every N").
CHECKPOINTED = "_fsdp2kit_checkpointed"
# On a block: True once compile_blocks compiled its forward.
COMPILED = "_fsdp2kit_compiled"
# On the root: the blocks in forward order, recorded by shard_model for set_prefetch.
BLOCK_ORDER = "_fsdp2kit_blocks"
# On a parameter fully_shard is about to replace: its name, so a stale optimizer can be named.
SHARDED_AS = "_fsdp2kit_sharded_as"
# On the root: {"tp": size, "plan": {module name: style}} once apply_tensor_parallel ran.
TENSOR_PARALLEL = "_fsdp2kit_tensor_parallel"
# On a sharded parameter that is frozen (a LoRA / QLoRA base): its name, so an optimizer holding it can be named.
FROZEN_AS = "_fsdp2kit_frozen_as"
# On the root: {"cp": size, "style": ..., "kernel": ..., "attn_implementation": ...} once apply_context_parallel ran.
CONTEXT_PARALLEL = "_fsdp2kit_context_parallel"
