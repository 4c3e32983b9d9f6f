"""The HTTP API's request and response bodies (pydantic: validation and the OpenAPI page at /docs).

A prediction follows Hugging Face's text-classification pipeline (``label`` and ``score``) and adds
every class probability and the notes ``classify.predict`` gives (what was truncated).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

EXAMPLE_TEXTS = ["A wonderful film, I loved every minute.", "Two hours I will never get back."]


class PredictRequest(BaseModel):
    """One review (``text``) or several (``texts``); answers come back in the same order."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"texts": EXAMPLE_TEXTS}]})

    texts: list[str] | None = Field(None, description="reviews to classify")
    text: str | None = Field(None, description="a single review (instead of texts)")

    @model_validator(mode="after")
    def _one_of_text_and_texts(self) -> "PredictRequest":
        if (self.texts is None) == (self.text is None):
            raise ValueError("give either 'text' (one review) or 'texts' (a list of reviews), not both or neither")
        if self.texts is not None and not self.texts:
            raise ValueError("'texts' is an empty list: give at least one review")
        return self

    @property
    def all_texts(self) -> list[str]:
        return self.texts if self.texts is not None else [self.text]  # type: ignore[list-item]


class ExplainRequest(PredictRequest):
    """As for /v1/predict, plus how many integrated-gradients steps to take (more: slower, more exact)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"text": EXAMPLE_TEXTS[0]}]})

    steps: int = Field(32, ge=1, le=128, description="integrated-gradients steps; 1 = plain gradient x input")


class Prediction(BaseModel):
    label: str = Field(description="the most probable class")
    score: float = Field(description="its probability")
    probabilities: dict[str, float] = Field(description="every class's probability")
    notes: list[str] = Field(description="what was truncated, if anything")


class PredictResponse(BaseModel):
    model: str = Field(description="id of the model that answered: run folder name @ weights digest")
    predictions: list[Prediction]


class Piece(BaseModel):
    """A stretch of the review as the model read it (normalised). ``score`` is a word's attribution to
    the predicted class (null between words); ``weight`` is it scaled to [-1, 1] for shading. A piece
    with empty text marks the middle that a truncated review's model never read."""

    text: str
    score: float | None
    weight: float | None


class Explanation(BaseModel):
    target: str = Field(description="the class the scores point towards (with two classes the second, positive "
                                    "one, whatever the answer; else the predicted one): a positive score pushed "
                                    "towards it")
    words: list[tuple[str, float]] = Field(description="each word the model read with its attribution")
    pieces: list[Piece] = Field(description="the review re-drawn: its words and the text between them")


class ExplainedPrediction(Prediction):
    explanation: Explanation


class ExplainResponse(BaseModel):
    model: str
    predictions: list[ExplainedPrediction]


class Status(BaseModel):
    status: str
    model: str | None = None


class ModelInfo(BaseModel):
    """What is loaded and how it is served."""

    id: str = Field(description="name@version: the model of every answer and its X-Model-Version header")
    name: str = Field(description="the run folder's name")
    version: str = Field(description="the first 12 hex digits of sha256: changes exactly when the weights do")
    sha256: str = Field(description="SHA-256 of the weights file (model.safetensors)")
    run: str = Field(description="the run folder")
    labels: list[str]
    parameters: int
    sizes: dict[str, Any] = Field(description="the model's config (config.json 'model')")
    truncation: str
    training: dict[str, Any] = Field(description="the run's training config and its last/best validation metrics")
    test: dict[str, Any] | None = Field(description="test_metrics.json, when the run was tested")
    runtime: dict[str, Any] = Field(description="device, precision, threads, batching settings and counts")


class ErrorResponse(BaseModel):
    """Every error: a message for a person, the HTTP status, and the details where there are several."""

    error: str
    status: int
    details: list[str] | None = None
