"""The benchmarks' GPT of a chosen shape, as a user's model factory (model.name =
"layout_model:gpt", with bench/ on PYTHONPATH): the built-in sizes stop at 5M parameters,
and the differences between layouts show on bigger models. The class is scaletrain's GPT,
so its ModelSpec (blocks, TP plan, pipeline split) comes with it."""

from scaletrain.models.gpt import GPT, GPTShape


def gpt(task, *, n_layer: int = 8, n_head: int = 8, n_embd: int = 448) -> GPT:
    return GPT(
        vocab_size=task.num_classes,
        block_size=task.input_shape[0],
        shape=GPTShape(n_layer=n_layer, n_head=n_head, n_embd=n_embd),
    )
