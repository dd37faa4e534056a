"""Language models (MECH): looped LMs trained on text and pretrained ones,
their validation loss per iteration, streamed analyses, sampling and the
from-scratch study."""
