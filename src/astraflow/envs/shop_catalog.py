"""The generated product catalogue of the ``shop`` environment and WebShop's reward.

Products belong to categories; each has a brand, a few attributes from its category's pool,
options (colours and sizes to choose from) and a price. An instruction is drawn from a target
product: two of its attributes, one colour, one size, and a price bound above its price.

Reward (WebShop's): ``r_type * (|attrs matched| + |options matched| + [price ok]) /
(|attrs asked| + |options asked| + 1)``, where ``r_type`` is 1 for the asked category, 0.5 for a
category sharing a word with it and 0.1 otherwise.
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass

from astraflow.envs.bm25 import Bm25Index

__all__ = ["Catalogue", "Instruction", "Product", "build_catalogue", "score_purchase"]

_CATEGORIES: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[int, int]]] = {
    # category: (attribute pool, sizes, price range)
    "t-shirt": (("cotton", "slim fit", "machine washable", "short sleeve", "v-neck",
                 "moisture wicking", "organic"), ("small", "medium", "large", "x-large"), (8, 40)),
    "running shoes": (("lightweight", "breathable", "non-slip", "memory foam", "waterproof",
                       "wide toe box"), ("size 7", "size 8", "size 9", "size 10", "size 11"),
                      (30, 160)),
    "hiking boots": (("waterproof", "leather", "ankle support", "non-slip", "insulated",
                      "lightweight"), ("size 8", "size 9", "size 10", "size 11", "size 12"),
                     (50, 220)),
    "backpack": (("water resistant", "laptop sleeve", "anti-theft", "lightweight", "usb port",
                  "padded straps"), ("20 liter", "30 liter", "40 liter"), (20, 120)),
    "headphones": (("wireless", "noise cancelling", "over-ear", "foldable", "long battery life",
                    "built-in microphone"), ("standard", "compact"), (20, 300)),
    "coffee maker": (("programmable", "stainless steel", "auto shut-off", "single serve",
                      "thermal carafe", "dishwasher safe"), ("4 cup", "8 cup", "12 cup"),
                     (25, 200)),
    "yoga mat": (("non-slip", "extra thick", "eco friendly", "carrying strap", "sweat resistant",
                  "foldable"), ("4mm", "6mm", "8mm"), (15, 80)),
    "desk lamp": (("dimmable", "usb port", "touch control", "led", "adjustable arm",
                   "eye-caring"), ("standard", "compact"), (15, 90)),
    "throw pillow": (("velvet", "machine washable", "hypoallergenic", "zipper closure",
                      "decorative", "down alternative"), ("16 inch", "18 inch", "20 inch"),
                     (10, 50)),
    "phone case": (("shockproof", "slim", "wireless charging compatible", "kickstand",
                    "screen protector", "clear"), ("iphone 14", "iphone 15", "galaxy s23"),
                   (8, 45)),
    "water bottle": (("insulated", "bpa free", "leak proof", "stainless steel", "wide mouth",
                      "straw lid"), ("18 oz", "24 oz", "32 oz", "40 oz"), (10, 50)),
    "rain jacket": (("waterproof", "packable", "hooded", "breathable", "windproof",
                     "reflective"), ("small", "medium", "large", "x-large"), (30, 180)),
}  # fmt: skip
_COLORS = (
    "black", "white", "navy", "red", "green", "grey", "blue", "pink", "beige", "olive",
    "purple", "orange",
)  # fmt: skip
_BRANDS = (
    "Alvero", "Brisk", "Corvan", "Dunmore", "Elkhorn", "Fenwick", "Galen", "Harlow", "Ivora",
    "Jasper", "Kestrel", "Lumen", "Marlow", "Norvik", "Orrin", "Pellar", "Quill", "Rowan",
    "Selby", "Tamsin",
)  # fmt: skip


@dataclass(frozen=True)
class Product:
    """One product page."""

    asin: str
    category: str
    brand: str
    title: str
    attributes: tuple[str, ...]
    colors: tuple[str, ...]
    sizes: tuple[str, ...]
    price: float


@dataclass(frozen=True)
class Instruction:
    """What the shopper asks for."""

    text: str
    category: str
    attributes: tuple[str, ...]
    color: str
    size: str
    max_price: float
    target: str
    """ASIN of the product the instruction was drawn from (one that satisfies it fully)."""


@dataclass(frozen=True)
class Catalogue:
    """Products, their BM25 index, and lookups by ASIN."""

    products: tuple[Product, ...]
    by_asin: dict[str, Product]
    index: Bm25Index

    def instruction(self, rng: random.Random, p: Product) -> Instruction:
        """A shopping instruction drawn from target product ``p``."""
        attrs = tuple(sorted(rng.sample(p.attributes, 2)))
        color, size = rng.choice(p.colors), rng.choice(p.sizes)
        bound = float(10 * math.ceil(p.price * rng.uniform(1.1, 1.6) / 10))
        text = (
            f"i am looking for a {attrs[0]} and {attrs[1]} {p.category} in {color} color and "
            f"{size} size, and price lower than {bound:.0f} dollars"
        )
        return Instruction(text, p.category, attrs, color, size, bound, p.asin)


def _product(rng: random.Random, n: int) -> Product:
    category = rng.choice(sorted(_CATEGORIES))
    pool, sizes, (lo, hi) = _CATEGORIES[category]
    brand = rng.choice(_BRANDS)
    attributes = tuple(sorted(rng.sample(pool, 3)))
    shown = rng.sample(attributes, 2)
    title = f"{brand} {shown[0].title()} {category.title()}, {shown[1].title()}"
    colors = tuple(sorted(rng.sample(_COLORS, rng.randint(2, 4))))
    chosen_sizes = tuple(s for s in sizes if rng.random() < 0.7) or sizes[:1]
    price = round(rng.uniform(lo, hi), 2)
    asin = f"B0{n:04d}{rng.randrange(16**4):04X}"
    return Product(asin, category, brand, title, attributes, colors, chosen_sizes, price)


@functools.cache
def build_catalogue(seed: int = 0, size: int = 3000) -> Catalogue:
    """``size`` products for ``seed`` (cached per process)."""
    if size < 10:
        raise ValueError("a shop catalogue needs at least 10 products")
    rng = random.Random(f"shop:{seed}")
    products = tuple(_product(rng, n) for n in range(size))
    texts = [f"{p.title} {p.category} {' '.join(p.attributes)}" for p in products]
    return Catalogue(products, {p.asin: p for p in products}, Bm25Index(texts))


def _type_match(asked: str, got: str) -> float:
    if asked == got:
        return 1.0
    return 0.5 if set(asked.split()) & set(got.split()) else 0.1


def score_purchase(
    goal: Instruction, product: Product, color: str | None, size: str | None
) -> float:
    """WebShop's reward for buying ``product`` with the chosen options."""
    attrs = sum(a in product.attributes for a in goal.attributes)
    options = (color == goal.color) + (size == goal.size)
    price = product.price <= goal.max_price
    total = len(goal.attributes) + 2 + 1
    return _type_match(goal.category, product.category) * (attrs + options + price) / total
