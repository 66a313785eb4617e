"""hvcomm: communication-efficient data-parallel training."""
