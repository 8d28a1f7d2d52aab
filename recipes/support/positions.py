"""The recipe refuses sequences longer than the model's positions unless the user raised the limit."""

from __future__ import annotations

from fsdp2kit.models import causal_lm_config, max_positions
from support.options import Config


def seq_len_problem(cfg: Config) -> str | None:
    """Why ``[data] seq_len`` exceeds the model's ``max_position_embeddings``, or None. Reads the config
    only, so it runs before any process group. A rotary model trains past its limit without an error,
    at positions a pretrained model never saw: only ``[model] max_position_embeddings`` says it is meant."""
    m, seq = cfg.model, cfg.data.seq_len
    limit = max_positions(causal_lm_config(m.name, max_position_embeddings=m.max_position_embeddings or None))
    if limit is None or seq <= limit:
        return None
    return (
        f"data.seq_len {seq} exceeds the model's max_position_embeddings {limit} ({m.name}): lower --data.seq_len, "
        f"or raise the limit explicitly with --model.max_position_embeddings {seq}"
    )
