"""The training recipe: data, the target feature cache, losses, calibration, the loop, the stages, and
`dspark prepare` (the embedded default target)."""
