"""DSpark speculative decoding: draft head, target model, verification, scheduler and engine."""

__version__ = "0.1.0"
