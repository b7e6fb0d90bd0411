"""What runs a step: weights, the model runner, drafts spliced into its batch, devices, the sampler, thread policy."""
