"""The RL loop and everything that touches tensors."""
