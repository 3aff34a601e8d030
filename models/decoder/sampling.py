"""The decoder's sampler: the runtime's model-independent `DeviceSampler`.

Nothing in device sampling depends on the model, so it lives in `runtime.sampling`; the decoder
executor attaches one as `model.sampling`. `DecoderSampler` stays as this family's name for it
(the runtime's error hints and the model-family guide use it).
"""

from __future__ import annotations

from runtime.sampling import DeviceSampler, SampleOutput, SamplerConfig, SamplerPlan

DecoderSampler = DeviceSampler

__all__ = ["DecoderSampler", "SampleOutput", "SamplerConfig", "SamplerPlan"]
