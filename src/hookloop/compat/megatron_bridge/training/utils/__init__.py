"""Megatron-Bridge's ``training.utils`` helpers the dialect reproduces."""
