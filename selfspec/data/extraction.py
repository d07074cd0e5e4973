"""Extraction prompts for structured output: a record written as text, and the JSON schema to fill.

The workload where a small model's exit pays (`decoding/grammar.py`): read a passage, answer with
JSON. Records come from `Faker` (seeded, so the same split on every machine), one kind per category,
each written by one of several templates so the text varies; the answer is the record itself, which
mostly copies spans of the prompt. A record belongs to the split its identifying value hashes to
(like the chat split by conversation id), so no person, product, event or call appears in two splits.

    prompts = extraction_prompts("test", per_category=4)
    prompts[0].message   # "Extract the information as JSON ...\n\nMaria Lopez (34) works as ..."
    prompts[0].schema    # {"type": "object", "properties": {"name": ..., "age": ...}, ...}
"""

from __future__ import annotations

import datetime
import hashlib
import json
import random
from dataclasses import dataclass

from ..errors import UserError

CATEGORIES = ("people", "products", "events", "tool_calls")
SPLITS = {"train": (0, 80), "validation": (80, 90), "test": (90, 100)}  # hash mod 100 ranges

_STRING = {"type": "string"}
SCHEMAS = {
    "people": {"type": "object", "properties": {
        "name": _STRING, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "city": _STRING,
        "email": _STRING, "job": _STRING}, "required": ["name", "age", "city", "email"],
        "additionalProperties": False},
    "products": {"type": "object", "properties": {
        "product": _STRING, "price": {"type": "number", "minimum": 0},
        "currency": {"enum": ["USD", "EUR", "GBP"]}, "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": _STRING, "maxItems": 4}},
        "required": ["product", "price", "currency", "in_stock"], "additionalProperties": False},
    "events": {"type": "object", "properties": {
        "title": _STRING, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "location": {"type": "object", "properties": {"venue": _STRING, "city": _STRING},
                     "required": ["venue", "city"], "additionalProperties": False},
        "attendees": {"type": "integer", "minimum": 0}},
        "required": ["title", "date", "location"], "additionalProperties": False},
    "tool_calls": {"type": "object", "properties": {
        "tool": {"enum": ["send_email", "create_event", "get_weather"]},
        "arguments": {"type": "object", "properties": {
            "to": _STRING, "subject": _STRING, "city": _STRING, "date": _STRING},
            "additionalProperties": False}},
        "required": ["tool", "arguments"], "additionalProperties": False},
}

_TEMPLATES = {
    "people": ["{name} is {age} years old and lives in {city}. {name} works as a {job} and can be reached "
               "at {email}.",
               "Contact card: {name}, age {age}, {job}, based in {city}. Email: {email}",
               "Meet {name} ({age}) from {city}. Occupation: {job}. You can write to {email}."],
    "products": ["The {product} costs {price} {currency} and is {stock_text}. Tags: {tags_text}.",
                 "Product: {product}. Price: {price} {currency}. Availability: {stock_text}.",
                 "{product}, listed at {price} {currency}, {stock_text} (categories: {tags_text})."],
    "events": ["{title} takes place on {date} at {venue} in {city}, with {attendees} people expected.",
               "Save the date: {date}. {title}, {venue}, {city}. Expected attendance: {attendees}.",
               "Join us for {title} in {city} ({venue}) on {date}."],
    "tool_calls": ["Please send an email to {to} with the subject \"{subject}\".",
                   "Put \"{subject}\" in my calendar for {date}.",
                   "What will the weather be like in {city} on {date}?"],
}
_INSTRUCTION = "Extract the information as JSON with the fields {fields}.\n\n{text}"


@dataclass(frozen=True)
class ExtractionPrompt:
    """One extraction task: its category, the user message, the schema and the record it states."""

    category: str
    message: str
    schema: dict
    record: dict


# Fixed date ranges: Faker's date_this_year/decade count from today, so the prompts (and the split
# of each record) would change from one day to the next.
_DECADE = (datetime.date(2020, 1, 1), datetime.date(2029, 12, 31))
_YEAR = (datetime.date(2026, 1, 1), datetime.date(2026, 12, 31))


def _record(fake, rng: random.Random, category: str) -> tuple[dict, dict]:
    """(the JSON answer, the template's fields) of one fake record."""
    if category == "people":
        answer = {"name": fake.name(), "age": rng.randint(18, 90), "city": fake.city(), "email": fake.email(),
                  "job": fake.job()}
        return answer, answer
    if category == "products":
        tags = [fake.word() for _ in range(rng.randint(1, 3))]
        name = f"{fake.color_name()} {fake.word().title()} {rng.choice(['Mug', 'Lamp', 'Shoes'])}"
        answer = {"product": name,
                  "price": round(rng.uniform(2, 300), 2), "currency": rng.choice(["USD", "EUR", "GBP"]),
                  "in_stock": rng.random() < 0.5, "tags": tags}
        fields = {**answer, "stock_text": "in stock" if answer["in_stock"] else "out of stock",
                  "tags_text": ", ".join(tags)}
        return answer, fields
    if category == "events":
        answer = {"title": f"{fake.catch_phrase()} Summit",
                  "date": fake.date_between_dates(*_DECADE).isoformat(),
                  "location": {"venue": f"{fake.last_name()} Hall", "city": fake.city()},
                  "attendees": rng.randint(10, 2000)}
        return answer, {**answer, **answer["location"]}
    tool = rng.choice(["send_email", "create_event", "get_weather"])
    values = {"to": fake.email(), "subject": fake.sentence(nb_words=4).rstrip("."), "city": fake.city(),
              "date": fake.date_between_dates(*_YEAR).isoformat()}
    names = {"send_email": ("to", "subject"), "create_event": ("subject", "date"),
             "get_weather": ("city", "date")}[tool]
    answer = {"tool": tool, "arguments": {name: values[name] for name in names}}
    return answer, {**values, "_template": ["send_email", "create_event", "get_weather"].index(tool)}


_IDENTITY = {"people": "name", "products": "product", "events": "title", "tool_calls": "arguments"}


def _split_of(category: str, answer: dict) -> str:
    """The split a record belongs to, from its identifying field: one person (product, event, call)
    is in one split only, whatever else its records say."""
    key = f"{category}:{json.dumps(answer[_IDENTITY[category]], sort_keys=True)}"
    bucket = int(hashlib.sha256(key.encode()).hexdigest(), 16) % 100
    return next(name for name, (low, high) in SPLITS.items() if low <= bucket < high)


def extraction_prompts(split: str = "test", per_category: int = 4, seed: int = 0,
                       categories=CATEGORIES) -> list[ExtractionPrompt]:
    """`per_category` prompts of each category in `split` (train, validation, test), category after
    category; the same arguments give the same prompts on every machine. Needs `Faker`."""
    if split not in SPLITS:
        raise UserError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise UserError(f"unknown extraction categories {sorted(unknown)}; "
                        f"choose from {', '.join(CATEGORIES)}")
    try:
        from faker import Faker
    except ImportError:
        raise UserError("extraction prompts need Faker: pip install 'selfspec[structured]'") from None
    out = []
    for category in categories:
        fake, rng = Faker("en_US"), random.Random(f"{seed}:{category}")
        fake.seed_instance(f"{seed}:{category}")
        found, attempts = 0, 0
        while found < per_category:
            attempts += 1
            if attempts > 100 * per_category + 1000:
                raise RuntimeError(f"no {split} record of {category} after {attempts} draws")
            answer, fields = _record(fake, rng, category)
            if _split_of(category, answer) != split:
                continue
            templates = _TEMPLATES[category]
            template = templates[fields.pop("_template")] if "_template" in fields else rng.choice(templates)
            schema = SCHEMAS[category]
            message = _INSTRUCTION.format(fields=", ".join(schema["properties"]),
                                          text=template.format(**fields))
            out.append(ExtractionPrompt(category, message, schema, answer))
            found += 1
    return out


__all__ = ["CATEGORIES", "SCHEMAS", "SPLITS", "ExtractionPrompt", "extraction_prompts"]
