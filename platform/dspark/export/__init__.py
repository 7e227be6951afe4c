"""Export a trained drafter for other engines: the speculators layout (vLLM's documented format) and
DeepSpec's checkpoint layout (SGLang, DeepSpec). One module per layout; what both share is in common."""

from dspark.export.common import default_verifier, reference
from dspark.export.deepspec import export_deepspec
from dspark.export.speculators import algorithm, aux_layer_ids, config, export_speculators, state_dict

__all__ = [
    "algorithm",
    "aux_layer_ids",
    "config",
    "default_verifier",
    "export_deepspec",
    "export_speculators",
    "reference",
    "state_dict",
]
