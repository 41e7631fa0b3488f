"""The built-in C++ model loaders (ferry/models.h): plans for an HF config.json and an
inference layout, without a loader written in Python."""
import json
import os

from . import _ferry
from .errors import InvalidArgumentError
from ._plan import Plan, _decls


def supported_architectures():
    """config.json `architectures` values ferry has a loader for."""
    return list(_ferry._supported_architectures())


class ModelLoader:
    """``ModelLoader(config, layout="tp=2,dp=1,ep=1,replicas=1", quantize="none", mtp="none")``.

    ``config``: a path to an HF config.json, its JSON text, or the parsed dict. The layout
    names the inference ranks: global rank = replica*(dp*tp) + dp_rank*tp + tp_rank.
    ``mtp``: a checkpoint's multi-token-prediction layers (DeepSeek-V3's
    ``num_nextn_predict_layers``): "none" (it has none), "skip" (accepted, not loaded, as
    vLLM's DeepseekV3ForCausalLM) or "draft" (loaded as vLLM's DeepSeekMTP names them:
    ``model.layers.{i}.mtp_block.*`` and the layer's own tensors; docs/models.md)."""

    def __init__(self, config, layout="tp=1", quantize="none", mtp="none"):
        args = (str(layout), str(quantize), str(mtp))
        if isinstance(config, dict):
            self._l = _ferry._ModelLoader.create(json.dumps(config), False, *args)
        elif isinstance(config, os.PathLike) or (isinstance(config, str) and not config.lstrip().startswith("{")):
            self._l = _ferry._ModelLoader.create(os.fspath(config), True, *args)
        elif isinstance(config, str):
            self._l = _ferry._ModelLoader.create(config, False, *args)
        else:
            raise InvalidArgumentError(f"ModelLoader: config must be a path, JSON text or a dict, got {type(config).__name__}")

    @property
    def architecture(self):
        return self._l.architecture

    @property
    def layout(self):
        return self._l.layout

    @property
    def world_size(self):
        return self._l.world_size

    @property
    def checkpoint(self):
        """{HF name: TensorDecl} of every checkpoint tensor (what a trainer exposes)."""
        return _decls(self._l.checkpoint())

    def params(self, rank):
        """{vLLM name: TensorDecl} of rank ``rank``'s params as loaded (what its plan writes)."""
        return _decls(self._l.params(int(rank)))

    def final_params(self, rank):
        """Params after post-processing (e.g. FP8 weights and their scales)."""
        return _decls(self._l.final_params(int(rank)))

    def rank_info(self, rank):
        """{global, replica, dp, tp, tp_size, dp_size, ep_size}"""
        return self._l.rank_info(int(rank))

    def record_plan(self, rank):
        """Rank ``rank``'s canonical plan, recorded from the C++ loader (coverage checked)."""
        return Plan(self._l.record_plan(int(rank)))

    def __repr__(self):
        return f"ferry.ModelLoader({self.architecture}, {self.layout})"
