"""Where tensors live: the eager and XLA backends, the device mesh, the partition specs."""
