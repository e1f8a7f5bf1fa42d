"""Device-bound model execution: loading weights and running one step of the model."""
