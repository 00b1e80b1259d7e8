"""What both backends and `mars convert` read and write without a framework: model and adapter
paths, the default model's files, Hugging Face config rules, the architecture table, adapter and
safetensors formats. Imports only `mars.core`."""
