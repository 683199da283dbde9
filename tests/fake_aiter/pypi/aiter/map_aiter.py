"""An async-iterator helper, as PyPI's ``aiter`` package has (the module name is what marks it)."""


async def map_aiter(fn, items):
    async for item in items:
        yield fn(item)
