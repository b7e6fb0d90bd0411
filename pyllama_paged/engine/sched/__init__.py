"""What runs next: requests and sequences, the scheduler, its output, preemption, the step-cost model."""
