"""Offline text for benchmark prompts: original prose written for llm-forge (no licence strings).

Prompts are cut from these sentences (seeded shuffles, then trimmed to an exact token count with
the engine's tokenizer), so workloads need no download and read like ordinary English.
"""
from __future__ import annotations

import random
import re

_TEXT = """
The harbour town woke before the sun, when the first boats slipped their ropes and moved out past
the breakwater. Fishermen called to each other across the water in short words that carried far
in the cold air. On the hill above the quay the baker opened his shutters and the smell of bread
drifted down the narrow streets. A lighthouse keeper climbed the spiral stairs one last time to
put out the lamp, and wrote the night's weather in a book that had been kept for ninety years.
The book recorded storms and calm nights alike, the names of ships that passed, and sometimes a
line about a seal that slept on the rocks below. Children ran to school along the sea wall,
counting the gulls and daring each other to touch the spray. By noon the market square was full
of crates of fish, baskets of apples from the valley farms, and stalls selling rope, nets, tar and
lamp oil. An old woman sold honey in small jars and told anyone who would listen that the bees
knew the weather better than the radio did.

In the valley behind the town a river ran over flat stones, turning two mills that had ground
flour since the time of the great flood. The miller kept a careful account of every sack, and on
winter evenings he taught his daughter to read the ledgers by candlelight. She learned that a
good record tells you not only what happened but also what was expected to happen, and that the
difference between the two is where the interesting questions live. When the spring rains came
the river rose quickly, and the whole village worked through the night to raise the banks with
sandbags. In the morning the water fell back, leaving a line of mud on the walls as a reminder.
Farmers walked their fields to see which crops had survived, and most of the barley stood firm.

A railway reached the valley at the end of that decade, and with it came letters, newspapers and
strangers with new ideas. The station master wore a pressed uniform and set his watch by the
telegraph signal from the capital every morning at eight. Trains carried timber and wool to the
cities and brought back machines, tools, books and cloth. Some people welcomed the change and
others feared it, but everyone agreed that the journey to the coast, which once took two days by
cart, now took less than three hours. The young went to the cities to study engineering, medicine
and law, and a few came back with plans for a school, a clinic and a small library.

The library opened in a former grain store with three hundred books and one long table. Its
first librarian believed that every question deserved an answer, even when the answer was that
nobody yet knew. She kept a notebook of the questions visitors asked: how far away the moon is,
why bread rises, how a steam engine turns heat into motion, what causes the tides, and how to
write a letter to a government office. Over the years the notebook grew into a catalogue of
curiosity, and teachers borrowed it to plan their lessons. When the town installed electric
lights in the main street, the library stayed open until ten in the evening, and it was rarely
empty.

Engineers who build large systems often say that measurement comes before improvement. A bridge
designer tests samples of steel until they break, a ship builder tows models through long tanks
of water, and a software team records how long each request takes before deciding what to
change. Averages hide the slow cases, so careful teams look at the distribution: the median
tells you what most people experience, and the tail tells you what the unlucky ones remember.
A system that is fast on average but occasionally stalls for several seconds will be described
by its users as slow. Good benchmarks are repeatable, state their conditions plainly, compare
like with like, and are honest about the noise in their numbers.

On the coast road a travelling cook set up a kitchen in a converted bus. Every day she wrote a
new menu on a chalkboard: soup of roasted tomatoes with basil, bread baked that morning, a stew
of beans and smoked fish, and a cake made with the valley's apples and honey. She bought what
the farmers and fishermen had in plenty, and she never cooked the same meal twice in a week.
People drove from neighbouring towns to eat at her folding tables, and in the evenings she
taught anyone who asked how to make a stock from bones and vegetable peelings, how to keep a
sourdough starter alive, and why salt should be added to beans only at the end.

Mountains rose to the north, and in summer walkers followed the old shepherds' paths to the high
lakes. The guides taught them to read the clouds: tall towers in the afternoon meant thunder,
a ring around the moon meant rain within a day, and a clear cold morning was the time to cross
the pass. At the top there was a stone hut with a stove, a shelf of tinned food, a log book and a
rule that whoever used the last match must leave a new box. Most people kept the rule, and the
log book filled with thanks, sketches of the view, and notes about the marmots that whistled
from the rocks whenever a stranger came near.

Astronomers from the university built a small observatory on a ridge above the lakes, far from
the lights of the town. On clear nights they measured the brightness of distant stars, looking
for the slight dimming that happens when a planet passes in front of its sun. The work was slow
and mostly consisted of checking instruments, recording temperatures and waiting for the clouds
to clear. Once a month they opened the dome to visitors, who queued in the cold to look through
the telescope at the rings of Saturn and the craters along the edge of the moon. Many of the
children who came on those evenings later said it was the night they decided what to study.

When winter returned, the harbour grew quiet again. Boats were pulled up on the slipway for
painting and repair, nets were mended in the sheds, and the lighthouse lamp burned longer each
evening. The baker made spiced bread for the festival, the library lent out more novels than at
any other season, and the old woman with the honey announced that the bees had gone to sleep
early, which meant a hard frost. She was right, as she usually was, and the town spent a week
under a clear sky so cold that the edge of the sea froze into thin plates of ice.
"""

SENTENCES: list[str] = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(_TEXT.split()))
                        if s.strip()]

SHORT_QUERIES: list[str] = [
    "cheap flights to the coast in spring", "how long to bake sourdough bread",
    "best hiking paths near mountain lakes", "what causes tides in the sea",
    "river flood protection sandbags how many", "library opening hours on sunday",
    "train timetable valley to capital", "how to keep a starter alive",
    "honey bees behaviour before frost", "telescope for looking at saturn rings",
    "bean stew with smoked fish recipe", "lighthouse keeper job history",
    "how does a steam engine work", "distance from earth to the moon",
    "repair fishing nets by hand", "why does bread rise",
]


# Small functions written for llm-forge, for prompts that edit code: (source, a name to rename).
CODE_SNIPPETS: list[tuple[str, str]] = [
    ("""def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
""", "subtotal"),
    ("""def moving_average(values, window):
    averages = []
    running = sum(values[:window])
    averages.append(running / window)
    for i in range(window, len(values)):
        running += values[i] - values[i - window]
        averages.append(running / window)
    return averages
""", "running"),
    ("""def parse_settings(lines):
    settings = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        settings[key.strip()] = value.strip()
    return settings
""", "settings"),
    ("""def find_gaps(timestamps, limit):
    gaps = []
    previous = timestamps[0]
    for current in timestamps[1:]:
        if current - previous > limit:
            gaps.append((previous, current))
        previous = current
    return gaps
""", "previous"),
]


def passage(rng: random.Random, min_words: int) -> str:
    """Consecutive sentences from a random starting point, wrapping around, >= `min_words` words."""
    start = rng.randrange(len(SENTENCES))
    words: list[str] = []
    i = start
    while len(words) < min_words:
        words.extend(SENTENCES[i % len(SENTENCES)].split())
        i += 1
    return " ".join(words)
