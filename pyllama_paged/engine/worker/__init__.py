"""What runs a step: weights, the model runner, devices, the sampler, step buffers, thread policy."""
