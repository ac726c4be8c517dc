"""Llama (LlamaForCausalLM): the reference dense decoder every other family builds on."""
