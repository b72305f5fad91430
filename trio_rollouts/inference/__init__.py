"""Inference: the interface agents call, and the backends that implement it."""

from ._interface import InferenceInterface as InferenceInterface
from ._interface import InferenceRequest as InferenceRequest
from ._interface import InferenceResponse as InferenceResponse
from ._interface import ReturnsLogProbs as ReturnsLogProbs
from ._interface import ReturnsRaw as ReturnsRaw
from ._interface import ReturnsTokens as ReturnsTokens
