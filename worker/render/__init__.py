"""One job from request to record: inputs, placement, generation, the timing record."""
