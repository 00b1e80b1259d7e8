"""Write the project's own instruction prompt set: data/prompts/{train,valid,test}.jsonl.

    python scripts/make_prompts.py [--out data/prompts] [--seed 0] [--test 150] [--valid 150]

Every prompt is composed from the templates and word lists in this file (no dataset text).
Each category draws from its own random stream derived from the seed, prompts are
deduplicated on normalised text (lowercase, collapsed whitespace) of the first user turn,
then shuffled once and cut into test, valid and train, so any prefix of a split is a random
sample across categories. The same seed gives byte-identical files.

One JSON object per line: `{"messages": [{"role": "user", "content": ...}], "category": ...}`;
multi-turn records also carry `"follow_ups"` (1 or 2 later user turns; the replies are
generated later by the model itself, see `mars distill`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

SPLITS = ("train", "valid", "test")


def _w(s: str) -> list[str]:
    """A word list written as 'a|b|c' (line breaks around items are ignored)."""
    return [x.strip() for x in s.split("|") if x.strip()]


def cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def normalise(text: str) -> str:
    return " ".join(text.lower().split())


# ---------------------------------------------------------------- length and style modifiers
SHORT_TAILS = _w("""Answer in one sentence.|Answer in two sentences.|Keep it brief.|Keep your answer under 50 words.|
    Please answer in under 30 words.|Be concise.|Use no more than three sentences.|One short paragraph, please.|
    Keep it short and simple.|A quick answer is fine.""")
LONG_TAILS = _w("""Please explain in detail.|Include an example.|Use simple language.|Give a step-by-step answer.|
    Write it for a complete beginner.|Answer with a short bulleted list.|Include one practical example.|
    Mention one common mistake too.""")
INLINE = _w("""in one sentence|in two sentences|in under 50 words|in simple terms|in a short paragraph|
    in three bullet points|step by step|in plain English|in a few words""")
AUDIENCES = _w("""a ten-year-old|a complete beginner|my grandmother|a high school student|
    someone who finds science boring|a new colleague|a five-year-old""")
NUMBERS = _w("two|three|three|three|four|five")


def tail(rng: random.Random, p_short: float = 0.45, p_long: float = 0.2) -> str:
    r = rng.random()
    if r < p_short:
        return " " + rng.choice(SHORT_TAILS)
    if r < p_short + p_long:
        return " " + rng.choice(LONG_TAILS)
    return ""


def fill(rng: random.Random, template: str, **slots) -> str:
    """Format a template; {L} is an optional inline length ('in one sentence'), {T} an
    optional trailing instruction ('Keep it brief.'), never both at once."""
    if "{L}" in template:
        slots["L"] = " " + rng.choice(INLINE) if rng.random() < 0.5 else ""
    if "{T}" in template:
        slots["T"] = "" if slots.get("L") else tail(rng)
    return template.format(**slots)


# ---------------------------------------------------------------- explain
DEVICES = _w("""a refrigerator|a microwave oven|a compass|a thermostat|a solar panel|a smoke detector|a touchscreen|
    GPS navigation|Wi-Fi|a heat pump|a rechargeable battery|an electric kettle|a dishwasher|a pin tumbler lock|a zipper|
    a flush toilet|a parachute|a hot air balloon|a submarine|an airplane wing|a pressure cooker|an induction hob|
    a barcode scanner|a vaccine|a search engine|a contactless card payment|a hybrid car|an elevator|a camera lens|
    a 3D printer|a wind turbine|a nuclear power plant|a QR code|a password manager|a spam filter|a sewing machine|
    a water filter|a mechanical watch|a metal detector|an electric motor|a loudspeaker|an LED|a fire extinguisher|
    a hydroelectric dam|an escalator|a recommendation algorithm|public key encryption|a compiler|a thermometer|
    a telescope|a microscope|a bicycle derailleur|a noise-cancelling headset|a blood pressure monitor""")
PROCESSES = _w("""photosynthesis turns sunlight into sugar|the heart pumps blood around the body|rain forms in clouds|
    yeast makes bread rise|the immune system fights off a cold|the moon causes tides|earthquakes happen|
    plants move water from their roots to their leaves|a seed grows into a plant|a message travels across the internet|
    muscles grow stronger after exercise|plastic bottles are recycled|coffee is decaffeinated|soap removes grease|
    a caterpillar turns into a butterfly|sound travels through air|glasses correct blurry vision|
    compound interest makes savings grow|inflation reduces the value of money|the kidneys clean the blood|
    volcanoes form|rivers carve valleys|snowflakes form|bees make honey|cheese is made from milk|
    the body digests a meal|the eye sees colour|the seasons change during the year|stars are born|fossils form|
    a rainbow appears after rain|salt melts ice on roads|a fever helps the body fight infection|
    a bank decides whether to give someone a loan""")
WHYS = _w("""the sky is blue|ice floats on water|onions make people cry|leaves change colour in autumn|
    we get goosebumps|
    bread goes stale|the ocean is salty|metal feels colder than wood at the same temperature|cats purr|we yawn|
    planes leave white trails in the sky|the moon looks bigger near the horizon|popcorn pops|
    our voice sounds different on a recording|fingers wrinkle in the bath|we need sleep|some people are left-handed|
    hot air rises|soap bubbles are round|stars twinkle|cut apples turn brown|we get hiccups|
    a moving bicycle stays upright|coffee keeps people awake|spicy food feels hot|
    shaking a soda can makes it fizz over|days are longer in summer|a spoon in a glass of water looks bent|dogs pant|
    it is easy to float in the Dead Sea|some clouds are grey and others are white|our ears pop on an airplane|
    we sometimes get a shock after walking on carpet|the Leaning Tower of Pisa leans|
    phones slow down as they get older|metal rusts|milk goes sour|thunder comes after lightning""")
CONCEPTS = _w("""supply and demand|opportunity cost|natural selection|gravity|entropy|machine learning|
    the greenhouse effect|herd immunity|recursion in programming|the water cycle|plate tectonics|democracy|
    the scientific method|a food chain|version control|cloud computing|the placebo effect|confirmation bias|
    a carbon footprint|black holes|the Doppler effect|a budget deficit|time zones|leap years|
    the law of diminishing returns|compound interest|probability|the circular economy""")


def gen_explain(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        t = rng.choice(
            [
                "Explain how {x} works{L}.",
                "How does {x} work?{T}",
                "Can you explain how {x} works{L}?",
                "I have never understood how {x} works. Can you explain it{L}?",
                "Give me a simple explanation of how {x} works.",
                "Explain how {x} works to {a}.",
            ]
        )
        return fill(rng, t, x=rng.choice(DEVICES), a=rng.choice(AUDIENCES))
    if kind == 1:
        t = rng.choice(
            [
                "Explain how {x}{L}.",
                "Describe how {x}{L}.",
                "Can you explain how {x}?{T}",
                "Walk me through how {x}.{T}",
                "Explain to {a} how {x}.",
            ]
        )
        return fill(rng, t, x=rng.choice(PROCESSES), a=rng.choice(AUDIENCES))
    if kind == 2:
        t = rng.choice(
            [
                "Explain why {x}{L}.",
                "Why is it that {x}?{T}",
                "Can you tell me why {x}?{T}",
                "What is the reason {x}?{T}",
                "I've always wondered why {x}. Can you explain{L}?",
                "My kid asked me why {x}. How should I explain it?",
                "Give a simple explanation of why {x}.",
            ]
        )
        return fill(rng, t, x=rng.choice(WHYS))
    t = rng.choice(
        [
            "Explain {x}{L}.",
            "Explain the idea of {x} to {a}.",
            "What is the basic idea behind {x}?{T}",
            "Help me understand {x}{L}.",
            "Explain {x} using an everyday analogy.",
        ]
    )
    return fill(rng, t, x=rng.choice(CONCEPTS), a=rng.choice(AUDIENCES))


# ---------------------------------------------------------------- definition
TERMS = [
    tuple(p.split(":"))
    for p in _w("""inflation:economics|algorithm:computer science|metaphor:literature|
    latency:networking|mortgage:personal finance|osmosis:biology|API:software development|equity:finance|
    catalyst:chemistry|gross domestic product:economics|firewall:computer security|ecosystem:ecology|
    mitochondria:biology|irony:literature|bandwidth:networking|molecule:chemistry|velocity:physics|momentum:physics|
    hypothesis:science|variable:programming|database:computing|recession:economics|dividend:investing|tariff:trade|
    biodiversity:ecology|stakeholder:business|syllabus:education|thesis:academic writing|plagiarism:academic writing|
    allergen:health|calorie:nutrition|antibiotic:medicine|umami:cooking|emulsion:cooking|marinade:cooking|
    braising:cooking|al dente:cooking|jet lag:travel|layover:travel|itinerary:travel|adverb:grammar|prefix:grammar|
    onomatopoeia:language|alliteration:writing|prime number:mathematics|median:statistics|perimeter:geometry|
    latitude:geography|delta:geography|monsoon:weather|humidity:weather|constitution:law|contract:law|
    credit score:personal finance|open source:software|cache:computing|pixel:digital images|encryption:security|
    phishing:computer security|metabolism:health|meditation:wellbeing|procrastination:psychology|
    empathy:psychology|deadline:project management|sprint:agile software development|overfitting:machine learning|
    photosynthesis:biology|gene:biology|erosion:geology|sonnet:poetry|budget:personal finance""")
]
VOCAB = _w("""serendipity|nostalgia|ubiquitous|ephemeral|pragmatic|meticulous|resilience|ambiguous|candid|frugal|
    eloquent|mundane|paradox|tenacious|whimsical|benevolent|procrastinate|vivid|obsolete|gregarious|melancholy|
    diligent|skeptical|sustainable|verbose|cynical|inevitable|lucid|nuance|quaint|redundant|scrutinize|trivial|
    zealous|wanderlust|jargon|euphemism|cliche|altruism|catharsis|dichotomy|epiphany|facetious|hubris|juxtapose|
    pensive|reluctant|sublime|tangible""")
ACRONYMS = _w("""NASA|DNA|HTML|CPU|GDP|UNESCO|FAQ|ASAP|PDF|USB|RSVP|SCUBA|LASER|ATM|CEO|ETA|DIY|FYI|URL|VIP|AI|UV|
    GPS|RAM|SMS|WHO|NGO|PIN|JPEG""")


def gen_definition(rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        term, field = rng.choice(TERMS)
        t = rng.choice(
            [
                "What does '{t}' mean?{T}",
                "Define '{t}'{L}.",
                "What is meant by '{t}' in {f}?{T}",
                "Give a short definition of the term '{t}'.",
                "In {f}, what does the term '{t}' mean?{T}",
                "Define '{t}' as it is used in {f}, in one sentence.",
                "What does '{t}' mean? Give one example.",
                "Explain the term '{t}' to {a}.",
            ]
        )
        return fill(rng, t, t=term, f=field, a=rng.choice(AUDIENCES))
    if kind == 1:
        t = rng.choice(
            [
                "What does the word '{w}' mean?",
                "Define '{w}' and use it in a sentence.",
                "What is the meaning of '{w}'? Keep it short.",
                "Explain the word '{w}' in simple terms.",
                "Give a one-sentence definition of '{w}' and one example sentence.",
                "What does '{w}' mean, and where does the word come from?",
            ]
        )
        return fill(rng, t, w=rng.choice(VOCAB))
    t = rng.choice(
        [
            "What does {x} stand for?",
            "What does {x} stand for, and what does it mean?",
            "Spell out the acronym {x} and explain it in one sentence.",
        ]
    )
    return fill(rng, t, x=rng.choice(ACRONYMS))


# ---------------------------------------------------------------- list
LIST_THINGS = _w("""fruits that are high in vitamin C|ways to save water at home|benefits of regular exercise|
    countries in South America|popular programming languages|things to pack for a beach holiday|
    reasons to learn a second language|common kitchen herbs|planets in our solar system|famous painters|
    ways to reduce stress|board games for families|household uses for baking soda|
    signs that a houseplant needs more water|renewable energy sources|mammals that live in the ocean|
    good questions to ask at the end of a job interview|habits of successful students|indoor hobbies for a rainy day|
    healthy breakfast ideas|instruments in a symphony orchestra|animals that hibernate|types of clouds|
    inventions that changed the world|classic novels worth reading|ways to make a small room feel bigger|
    vegetables that grow well in pots|cheap date ideas|sources of plant protein|birds that cannot fly|
    ancient civilizations|things you can recycle|famous bridges|ways to practise gratitude|low-cost gift ideas|
    common logical fallacies|spices used in Indian cooking|symptoms of dehydration|safety rules for a science lab|
    icebreaker questions for a team meeting|fun facts about octopuses|ways to use leftover rice|
    things to check before a long road trip|features of a strong password|desert animals|European capital cities|
    words that describe the sea|ways to keep a conversation going|careers that involve working with animals|
    tools every home should have|kinds of pasta|dog breeds that are good with children|sports played with a ball|
    qualities of a good team leader|winter activities|common mistakes new drivers make|basic SQL commands|
    Python built-in functions|keyboard shortcuts that save time|ways to reduce food waste|parts of a plant cell|
    rivers in Africa|questions to ask a landlord before renting|signs of a phishing email|
    ways to stay warm without turning up the heating|things to do on a long train ride|easy dinners for a busy week|
    famous scientists|national parks worth visiting|ways to be a better listener|elements on the periodic table""")


def gen_list(rng: random.Random) -> str:
    t = rng.choice(
        [
            "List {n} {x}.",
            "Name {n} {x}.",
            "Give me {n} {x}, one per line.",
            "What are {n} {x}?",
            "List {n} {x} and add a short reason for each.",
            "Write a bulleted list of {n} {x}.",
            "List {n} {x}. Use no more than five words per item.",
            "Can you name {n} {x}?",
            "Quickly list {n} {x}.",
            "I need {n} {x}. Just the list, please.",
            "List {n} {x}, with one sentence about each.",
        ]
    )
    return fill(rng, t, n=rng.choice(NUMBERS), x=rng.choice(LIST_THINGS))


# ---------------------------------------------------------------- writing
POEM_TOPICS = _w("""autumn leaves|a rainy Monday morning|the first cup of coffee|the ocean at night|a lost umbrella|
    city lights|the first snow of winter|a quiet library|a mountain lake|a long train journey|a sunflower|
    an old bicycle|a thunderstorm|a cat asleep in the sun|moving to a new city|a garden in spring|
    the smell of fresh bread|a lighthouse|the last day of school|a full moon|a busy kitchen|waiting for a bus|
    a paper boat|the desert at dawn|a forgotten letter|friendship|homesickness|a marathon runner|
    rain on a tin roof|a farmers' market|a melting snowman|a broken clock|fireflies|a late-night phone call|
    the first day at a new job|a grandmother's recipe|a cup of tea|a crowded subway|a kite in the wind|
    falling asleep on a plane|a Monday to-do list|an empty playground|a software bug at 2 a.m.""")
CHARACTERS = _w("""a lighthouse keeper|a retired astronaut|a nervous chef|a talking dog|a shy librarian|
    a young inventor|
    a lonely robot|a skateboarding grandmother|a detective on her first day|a farmer|
    a seasick pirate|a friendly ghost|a time traveller|a street musician|an adventurous cat|
    a schoolteacher|a small dragon|a delivery driver|a chess champion|a gardener""")
EVENTS = _w("""finds a mysterious key|loses their voice before a big speech|wakes up in the wrong century|
    wins a baking contest by accident|misses the last train home|receives a letter with no sender|
    discovers a door that wasn't there yesterday|gets stuck in an elevator with a celebrity|finds a map in an old book|
    adopts a very strange pet|forgets their own birthday|meets their future self|has to cook for a hundred guests|
    hears a knock at midnight|finds a message in a bottle|swaps lives with their neighbour for a day""")
BUSINESSES = _w("""a bakery that only sells sourdough|a bike repair shop|a city recycling campaign|
    a dog-walking service|
    the local public library|a coffee cart|an eco-friendly laundry detergent|a maths tutoring service|
    a neighbourhood running club|a plant nursery|a second-hand bookshop|a vegan food truck|a language-learning app|
    a window-cleaning company|a summer coding camp|a reusable water bottle|a yoga studio|a family-run pizzeria|
    a car-sharing service|a campaign to get young people to vote|a night market|a repair cafe""")
EMAILS = _w("""to my manager asking for next Friday off|to a colleague thanking them for their help on the project|
    to my landlord reporting a leaking kitchen tap|to a teacher asking for an extension on my essay|
    to a customer apologising for a late delivery|to my neighbours inviting them to a street party|
    to a friend cancelling dinner plans|to a client confirming our meeting on Thursday at 10 a.m.|
    to the team announcing that the office will be closed on Monday|
    to a hotel asking whether they have a room with a sea view|to a recruiter following up after an interview|
    to my gym cancelling my membership|to a supplier asking for an updated price list|
    to my team welcoming a new colleague|to a professor asking to join their research project|
    to a plumber asking for a quote|to a friend congratulating them on their new job|
    to the HR department asking about the remote work policy|
    to a restaurant asking if they can host a birthday dinner for twelve|
    to my doctor's office asking to move my appointment""")
ANNOUNCEMENTS = _w("""the opening of our new cafe|a charity run this Saturday|the release of version 2.0 of our app|
    a free coding workshop for teenagers|our bakery's new gluten-free bread|a park clean-up day|
    a 20% discount for students|a new podcast episode about space|a lost dog found in the park|
    our library's new late opening hours|a community garden looking for volunteers""")
RECIPIENTS = _w("""my best friend|my grandfather, who turns 90|a coworker I don't know well|my little sister|
    my favourite teacher|my boss|a neighbour who just had a baby|my cousin who is graduating""")
GIFTS = _w("""a handmade scarf|helping me move house|a great book recommendation|looking after my cat|
    a birthday cake|driving me to the airport|lending me their tent""")
THEMES = _w("patience|hard work|failure|starting over|learning|kindness|courage|teamwork|curiosity|rest")
GENRES = _w("mystery|science fiction|romance|fantasy|thriller|comedy")
SETTINGS = _w("""a small fishing village|a space station|Paris in 1920|a school for wizards|
    an abandoned shopping mall|a desert town|a floating city|a hospital at night""")
RIDDLE_OBJECTS = _w("a clock|an umbrella|a shadow|a candle|a key|a mirror|the moon|a book|an egg|a towel|a map")


def gen_writing(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind == 0:
        t = rng.choice(
            [
                "Write a haiku about {x}.",
                "Write a haiku about {x}, then give it a title.",
                "Write a short poem about {x}.",
                "Write a four-line poem about {x}.",
                "Write a rhyming couplet about {x}.",
                "Write a limerick about {x}.",
                "Write a free-verse poem of no more than six lines about {x}.",
                "Write a cheerful haiku about {x}.",
                "Write a sad haiku about {x}.",
            ]
        )
        return fill(rng, t, x=rng.choice(POEM_TOPICS))
    if kind == 1:
        t = rng.choice(
            [
                "Write a two-sentence story about {c} who {e}.",
                "Write a very short story (under 100 words) about {c} who {e}.",
                "Tell me a three-sentence story about {c} who {e}.",
                "Write a two-sentence spooky story about {c} who {e}.",
                "Write the opening line of a story about {c} who {e}.",
                "Write a 50-word story about {c} who {e}, with a twist ending.",
            ]
        )
        return fill(rng, t, c=rng.choice(CHARACTERS), e=rng.choice(EVENTS))
    if kind == 2:
        t = rng.choice(
            [
                "Write a slogan for {b}.",
                "Come up with a catchy slogan for {b}.",
                "Suggest three short slogans for {b}.",
                "Write a slogan for {b} in under eight words.",
                "Write a two-sentence advert for {b}.",
                "Write a tweet promoting {b}.",
            ]
        )
        return fill(rng, t, b=rng.choice(BUSINESSES))
    if kind == 3:
        t = rng.choice(
            [
                "Write a short email {e}.",
                "Write a polite email {e}.",
                "Draft a friendly email {e}. Keep it under 100 words.",
                "Write a formal email {e}.",
                "Write a three-sentence email {e}.",
                "Help me write an email {e}.",
            ]
        )
        return fill(rng, t, e=rng.choice(EMAILS))
    if kind == 4:
        t = rng.choice(
            [
                "Write a tweet announcing {a}.",
                "Write a tweet announcing {a}, with two hashtags.",
                "Write a tweet about {x} in under 200 characters.",
                "Write a funny tweet about {x}.",
                "Write a short social media post announcing {a}.",
            ]
        )
        return fill(rng, t, a=rng.choice(ANNOUNCEMENTS), x=rng.choice(POEM_TOPICS))
    t = rng.choice(
        [
            "Write a birthday message for {r}.",
            "Write a short thank-you note to {r} for {g}.",
            "Write a motivational quote about {m}.",
            "Write an opening line for a {genre} novel set in {s}.",
            "Write a riddle about {o}, and give the answer.",
            "Write a two-line toast for {r}.",
            "Describe {s} in three vivid sentences.",
        ]
    )
    return fill(
        rng,
        t,
        r=rng.choice(RECIPIENTS),
        g=rng.choice(GIFTS),
        m=rng.choice(THEMES),
        genre=rng.choice(GENRES),
        s=rng.choice(SETTINGS),
        o=rng.choice(RIDDLE_OBJECTS),
    )


# ---------------------------------------------------------------- rewrite (sentences the script composes)
SUBJECTS = _w("""The team|My neighbour|Our manager|The students|The city council|My brother|The new intern|
    The company|Our teacher|The committee|My aunt|The restaurant owner""")
PREDICATES = _w("""finished the report two days early|decided to postpone the meeting|fixed the broken printer|
    planted tomatoes in the back garden|cancelled the trip because of the storm|
    ordered far too much pizza for the party|
    forgot to lock the front door|raised prices for the third time this year|painted the fence bright yellow|
    won an award for the new design|lost the keys to the storage room|moved the deadline to next month|
    hired two new people|replaced the old windows|spent the whole weekend cleaning the garage""")
WHENS = ["yesterday", "last week", "on Monday", "after lunch", "this morning", "at the last minute", ""]
INFORMAL_OPEN = _w("hey,|ok so|hi,|yo,|sorry but|lol|hiya,|um,")
INFORMAL_BODY = _w("""can u send me the file asap|gonna be late, traffic is crazy|
    thx for the help yesterday, u saved me|
    the meeting got moved, no idea why|i cant make it tmrw, something came up|this report is kinda a mess tbh|
    we need more coffee in the office, like seriously|pls tell the boss the printer is broken again|
    the client wants changes AGAIN|just checking if u saw my last msg|wanna grab lunch later|
    the wifi is dead, cant do anything|the new guy is pretty cool actually|ur invoice is late btw|
    i think we should totally change the plan|no way we finish this by friday""")
ERRORS = [
    "{Pl} was really excited about the {event}.",
    "{Sg} don't like {food} at all.",
    "Me and {friend} goes to the {place} every {day}.",
    "{Sg} have went to the {place} {time}.",
    "Their going to the {place} {time}.",
    "{Sg} should of called before coming.",
    "Its to late to change the {thing} now.",
    "{Sg} buyed three {items} {time}.",
    "Between you and I, the {event} was {adj}.",
    "The {items} is on the table, next to {friend}'s bag.",
    "Who's {thing} is this?",
    "{Sg} dont know where the {place} is.",
    "There is many reasons to visit the {place}.",
    "Less people came to the {event} than we expected.",
    "Your welcome to join us at the {place} {time}.",
    "I seen {friend} at the {place} {time}.",
    "The {thing} need to be finished by {due}.",
    "{Sg} and me was late for the {event}.",
    "Every one of the {items} were damaged.",
]
SLOTS = {
    "Pl": _w("The children|My parents|The players|Our guests|The neighbours"),
    "Sg": _w("She|My sister|He|Our teacher|The manager|My friend Tom"),
    "friend": _w("Sarah|my cousin|Daniel|my roommate|Priya|Carlos"),
    "event": _w("concert|school trip|football match|party|conference|wedding"),
    "food": _w("spinach|spicy food|mushrooms|coffee|olives"),
    "place": _w("library|beach|gym|museum|market|station|park"),
    "day": _w("Saturday|Friday|weekend|morning"),
    "time": _w("yesterday|last week|this morning|on Sunday"),
    "thing": _w("plan|report|schedule|presentation|menu"),
    "items": _w("apples|books|tickets|notebooks|chairs|boxes"),
    "adj": _w("boring|too long|amazing|a disaster"),
    "due": _w("Friday|tomorrow|the end of the week|noon"),
}
WORDY = [
    "Due to the fact that {reason}, we are at this point in time unable to {act}.",
    "In order to {act}, it is absolutely necessary and essential that we {need}.",
    "At the present moment in time, the team is currently in the process of {doing}.",
    "It is my personal opinion that I think that {claim}.",
    "I am writing this message in order to let you know that {claim}.",
]
WORDY_SLOTS = {
    "reason": _w("the weather is bad|the budget was cut|the system is down|two people are sick"),
    "act": _w("finish the project on time|open the store|ship the order|hold the meeting"),
    "need": _w("work together as a team|plan ahead in advance|communicate clearly with each other"),
    "doing": _w("reviewing the applications|writing the final report|moving to a new office|testing the new app"),
    "claim": _w(
        "the meeting should be shorter|we should hire more staff|the new design looks better|"
        "the deadline is not realistic"
    ),
}
TOWNS = _w("Millbrook|Ashford|Riverton|Oakvale|Greenhill|Port Ellis|Stonebridge|Westmere")
MONTHS = _w("January|February|March|April|May|June|July|August|September|October|November|December")
WEEKDAYS = _w("Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday")
PEOPLE_NAMES = _w("Maya|Leo|Aisha|Tom|Sofia|Ravi|Emma|Kenji|Lucia|Omar|Nina|Jonas|Grace|Mateo|Hana|Ben")
PARAGRAPHS = [
    (
        "The {town} Public Library will close for renovations from {m1} 3 to {m2} 28. During this time, books can be "
        "returned at the {town2} branch, which will extend its opening hours. Online services, including e-book loans, "
        "will continue as usual. The library expects to reopen with a larger children's area and a new study room."
    ),
    (
        "A small study followed {n} adults for {w} weeks. Half of them walked for 30 minutes each day, while the other "
        "half kept their usual routine. The walkers reported better sleep and slightly lower stress. The researchers "
        "say larger studies are needed before drawing firm conclusions."
    ),
    (
        "A local company has announced a new electric scooter that will go on sale in {m1}. It is lighter than the old "
        "model and goes twice as far on a single charge. Early reviewers praised the design but complained about the "
        "price of {price} dollars. Pre-orders open next week."
    ),
    (
        "Heavy rain is expected across {town} on {dayname}, with up to {n} millimetres in some areas. Drivers have "
        "been advised to avoid unnecessary journeys. Several outdoor events, including the {town} food festival, have "
        "been postponed. The weather should improve by the weekend."
    ),
    (
        "In today's meeting, the team agreed to move the launch date to {m1} {d}. {a} will finish the user testing by "
        "Friday, and {b} will update the budget. The marketing plan is still not final and will be discussed again "
        "next week. Everyone was asked to send their feedback by email."
    ),
    (
        "The town of {town} voted to turn its old train station into a community centre. The project will cost about "
        "{w} million and include a cafe, a small theatre and rooms for local clubs. Some residents worry about "
        "parking, while others say the building has been empty for too long. Work is expected to begin next spring."
    ),
    (
        "To make a simple tomato soup, soften an onion and two cloves of garlic in olive oil. Add {w} chopped "
        "tomatoes, a cup of stock and a pinch of salt, then simmer for {d} minutes. Blend until smooth and season to "
        "taste. Serve with fresh bread or a spoon of yoghurt."
    ),
    (
        "The old stone bridge in {town} was built in {year} to connect the two halves of the town. At the time, it was "
        "the longest bridge of its kind in the region. It was damaged in a flood in {year2} and rebuilt within two "
        "years. Today it is one of the most photographed places in the area."
    ),
    (
        "I ordered a coffee machine from your website on {m1} {d}, and it arrived {w} days late. When I opened the "
        "box, the water tank was missing. I called customer service twice, but nobody answered. I would like either "
        "the missing part or a full refund."
    ),
    (
        "{a} started learning the guitar at the age of {n}. At first, {a} practised for ten minutes a day, mostly "
        "simple chords. After a year, {a} could play a dozen songs and joined a small band with {b}. They now play at "
        "a cafe in {town} every month."
    ),
]


def _sentence(rng: random.Random) -> str:
    when = rng.choice(WHENS)
    return f"{rng.choice(SUBJECTS)} {rng.choice(PREDICATES)}{' ' + when if when else ''}."


def _informal(rng: random.Random) -> str:
    return f"{rng.choice(INFORMAL_OPEN)} {rng.choice(INFORMAL_BODY)}{rng.choice(['', '!', '??', ' :)', '...'])}"


def _pick_slots(rng: random.Random, slots: dict) -> dict:
    return {k: rng.choice(v) for k, v in slots.items()}


def _paragraph(rng: random.Random) -> str:
    a, b = rng.sample(PEOPLE_NAMES, 2)
    town, town2 = rng.sample(TOWNS, 2)
    m1, m2 = rng.sample(MONTHS, 2)
    year = rng.randrange(1820, 1960)
    return rng.choice(PARAGRAPHS).format(
        town=town,
        town2=town2,
        m1=m1,
        m2=m2,
        n=rng.randrange(8, 90),
        w=rng.randrange(3, 13),
        d=rng.randrange(2, 29),
        price=rng.choice([399, 450, 499, 549, 649, 799]),
        dayname=rng.choice(WEEKDAYS),
        a=a,
        b=b,
        year=year,
        year2=year + rng.randrange(20, 60),
    )


def gen_rewrite(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind == 0:
        t = rng.choice(
            [
                'Paraphrase this sentence: "{s}"',
                'Rewrite this sentence in the passive voice: "{s}"',
                'Say this in a different way: "{s}"',
                'Rewrite this sentence to sound more positive: "{s}"',
                'Turn this sentence into a question: "{s}"',
                'Make this sentence more dramatic: "{s}"',
                'Rewrite this as a short news headline: "{s}"',
                'Rewrite this sentence in the future tense: "{s}"',
            ]
        )
        return t.format(s=_sentence(rng))
    if kind == 1:
        t = rng.choice(
            [
                'Make this message more formal: "{s}"',
                'Rewrite this in a professional tone: "{s}"',
                'Turn this text message into one polite sentence for an email: "{s}"',
                'Rewrite this so I could send it to my manager: "{s}"',
                'Fix the spelling and make this sound professional: "{s}"',
            ]
        )
        return t.format(s=_informal(rng))
    if kind == 2:
        t = rng.choice(
            [
                'Fix the grammar in this sentence: "{s}"',
                'Correct any mistakes in this sentence: "{s}"',
                'What\'s wrong with this sentence, and how would you fix it? "{s}"',
                'Proofread this: "{s}"',
                'Correct the grammar and explain the mistake briefly: "{s}"',
            ]
        )
        return t.format(s=rng.choice(ERRORS).format(**_pick_slots(rng, SLOTS)))
    if kind == 3:
        t = rng.choice(
            [
                'Make this sentence more concise: "{s}"',
                'Shorten this sentence without losing the meaning: "{s}"',
                'Rewrite this in plain English: "{s}"',
            ]
        )
        return t.format(s=rng.choice(WORDY).format(**_pick_slots(rng, WORDY_SLOTS)))
    t = rng.choice(
        [
            "Summarise this in one sentence:\n\n{p}",
            "Give a one-line summary of the following text:\n\n{p}",
            "Summarise the following in under 30 words:\n\n{p}",
            "Write a short headline for this text:\n\n{p}",
            "Rewrite this paragraph for a ten-year-old:\n\n{p}",
            "Turn this paragraph into three bullet points:\n\n{p}",
            "Give me a TL;DR of this:\n\n{p}",
            "Paraphrase this paragraph in a more formal tone:\n\n{p}",
        ]
    )
    return t.format(p=_paragraph(rng))


# ---------------------------------------------------------------- reasoning and arithmetic
NAMED = [
    ("Maya", "she", "her", "her"),
    ("Leo", "he", "his", "him"),
    ("Aisha", "she", "her", "her"),
    ("Tom", "he", "his", "him"),
    ("Sofia", "she", "her", "her"),
    ("Ravi", "he", "his", "him"),
    ("Emma", "she", "her", "her"),
    ("Kenji", "he", "his", "him"),
    ("Lucia", "she", "her", "her"),
    ("Omar", "he", "his", "him"),
    ("Nina", "she", "her", "her"),
    ("Jonas", "he", "his", "him"),
]
COUNTABLES = _w("apples|stickers|marbles|pencils|cookies|stamps|seashells|trading cards|books|sweets")
PRICED = _w("notebooks|coffees|bus tickets|sandwiches|pens|cupcakes|postcards")
UNITS = [
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("metres", "centimetres", 100),
    ("kilometres", "metres", 1000),
    ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000),
    ("feet", "inches", 12),
    ("weeks", "days", 7),
    ("days", "hours", 24),
    ("years", "months", 12),
]
NUMERIC_TAILS = [
    "",
    "",
    "",
    " Show your work.",
    " Answer with just the number.",
    " Explain your reasoning in one sentence.",
    " Think step by step.",
    " Give the answer and a one-line explanation.",
]
OTHER_TAILS = ["", "", " Explain your reasoning in one sentence.", " Think step by step.", " Answer briefly."]


def _sequence(rng: random.Random) -> list[int]:
    kind = rng.randrange(5)
    if kind == 0:
        a, d = rng.randrange(1, 30), rng.randrange(2, 12)
        return [a + d * i for i in range(5)]
    if kind == 1:
        a, d = rng.randrange(60, 120), rng.randrange(3, 12)
        return [a - d * i for i in range(5)]
    if kind == 2:
        a, r = rng.randrange(1, 6), rng.choice([2, 3])
        return [a * r**i for i in range(5)]
    if kind == 3:
        k = rng.randrange(1, 9)
        return [(k + i) ** 2 for i in range(4)]
    s = [rng.randrange(1, 5), rng.randrange(1, 6)]
    while len(s) < 6:
        s.append(s[-1] + s[-2])
    return s


def _reasoning_problem(rng: random.Random) -> tuple[str, bool]:
    """A small problem and whether its answer is a single number."""
    kind = rng.randrange(16)
    (n1, s1, p1, o1), (n2, *_) = rng.sample(NAMED, 2)
    if kind == 0:
        a, b = rng.randrange(10, 999), rng.randrange(10, 999)
        t = rng.choice(
            ["What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "Calculate {a} plus {b}."]
        )
        return t.format(a=a, b=b), True
    if kind == 1:
        a, b = sorted(rng.sample(range(10, 1000), 2), reverse=True)
        return rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.", "What is {a} minus {b}?"]).format(
            a=a, b=b
        ), True
    if kind == 2:
        a, b = rng.randrange(2, 26), rng.randrange(2, 26)
        return rng.choice(["What is {a} times {b}?", "Multiply {a} by {b}.", "What is {a} * {b}?"]).format(
            a=a, b=b
        ), True
    if kind == 3:
        b, q = rng.randrange(2, 13), rng.randrange(2, 31)
        return rng.choice(["What is {a} divided by {b}?", "What is {a} / {b}?"]).format(a=b * q, b=b), True
    if kind == 4:
        p, n = rng.choice([5, 10, 15, 20, 25, 50, 75]), 20 * rng.randrange(1, 21)
        return rng.choice(["What is {p}% of {n}?", "Calculate {p} percent of {n}."]).format(p=p, n=n), True
    if kind == 5:
        n = rng.randrange(2, 200)
        return rng.choice(
            ["Is {n} a prime number?", "Is {n} prime? Explain how you checked.", "What is {n} squared?"]
        ).format(n=n), False
    if kind == 6:
        a, b = rng.randrange(12, 60), rng.randrange(2, 12)
        return (
            f"{n1} has {a} {rng.choice(COUNTABLES)}. {cap(s1)} gives {b} of them to {n2}. "
            f"How many does {n1} have left?",
            True,
        )
    if kind == 7:
        q, price, item = rng.randrange(2, 8), rng.randrange(2, 13), rng.choice(PRICED)
        total = q * price
        if rng.random() < 0.5:
            return f"{n1} buys {q} {item} that cost ${price} each. How much does {s1} spend in total?", True
        note = next(x for x in (10, 20, 50, 100) if x > total)
        return (
            f"{n1} buys {q} {item} at ${price} each and pays with a ${note} note. How much change does {s1} get?",
            True,
        )
    if kind == 8:
        s, h = rng.choice([40, 50, 60, 75, 80, 90, 120]), rng.randrange(2, 6)
        if rng.random() < 0.5:
            return f"A train travels at {s} km/h for {h} hours. How far does it go?", True
        return f"A car covers {s * h} km in {h} hours. What is its average speed?", True
    if kind == 9:
        h, mm, dur = rng.randrange(1, 10), rng.choice([0, 15, 20, 30, 45, 50]), rng.choice([85, 95, 100, 110, 125, 140])
        return f"A film starts at {h}:{mm:02d} p.m. and lasts {dur} minutes. What time does it end?", False
    if kind == 10:
        k, q = rng.randrange(2, 9), rng.randrange(2, 10)
        if rng.random() < 0.5:
            return f"{k} friends share {k * q} cookies equally. How many cookies does each friend get?", True
        r = rng.randrange(1, k)
        return (
            f"{k} friends share {k * q + r} cookies equally. How many does each get, and how many are left over?",
            False,
        )
    if kind == 11:
        a, b, c = rng.randrange(5, 40), rng.randrange(2, 10), rng.randrange(2, 15)
        return (
            f"{n1} is {a} years old. {cap(p1)} brother is {b} years older. How old will the brother be in {c} years?",
            True,
        )
    if kind == 12:
        a, w = rng.choice([5, 8, 10, 12, 15, 20, 25]), rng.randrange(4, 30)
        return f"{n1} saves ${a} every week. How many weeks will it take {o1} to save ${a * w}?", True
    if kind == 13:
        w, length = rng.randrange(3, 20), rng.randrange(3, 20)
        what = rng.choice(["area", "perimeter"])
        return f"A rectangle is {w} cm wide and {length} cm long. What is its {what}?", True
    if kind == 14:
        x, y, z = (n[0] for n in rng.sample(NAMED, 3))
        adj, q = rng.choice(
            [
                ("taller", "Who is the shortest?"),
                ("older", "Who is the youngest?"),
                ("faster", "Who is the slowest?"),
                ("heavier", "Who is the lightest?"),
            ]
        )
        return f"{x} is {adj} than {y}, and {y} is {adj} than {z}. {q}", False
    day, n = rng.choice(WEEKDAYS), rng.randrange(3, 40)
    return f"If today is {day}, what day of the week will it be in {n} days?", False


def gen_reasoning(rng: random.Random) -> str:
    kind = rng.randrange(5)
    if kind <= 1:
        text, numeric = _reasoning_problem(rng)
    elif kind == 2:
        sub = rng.randrange(4)
        if sub == 0:
            fractions = [(1, 2), (2, 3), (3, 4), (3, 5), (5, 8), (4, 7), (2, 5), (5, 6), (7, 10), (3, 8)]
            (a, b), (c, d) = rng.sample(fractions, 2)
            text, numeric = f"Which is larger: {a}/{b} or {c}/{d}?", False
        elif sub == 1:
            x, y = rng.randrange(1, 100) / 100, rng.randrange(1, 10) / 10
            text, numeric = (f"Which is bigger, {x} or {y}?" if x != y else f"Is {x} equal to {y}?"), False
        elif sub == 2:
            nums = rng.sample(range(-20, 200), 6)
            text, numeric = f"Sort these numbers from smallest to largest: {', '.join(map(str, nums))}.", False
        else:
            a, b, c = rng.randrange(3, 15), rng.randrange(3, 15), rng.randrange(20, 200)
            text, numeric = f"Is {a} times {b} greater than {c}?", False
    elif kind == 3:
        big, small, f = rng.choice(UNITS)
        n = rng.randrange(2, 13)
        sub = rng.randrange(3)
        if sub == 0:
            text = rng.choice(["How many {s} are in {n} {b}?", "Convert {n} {b} to {s}."]).format(s=small, n=n, b=big)
        elif sub == 1:
            text = f"How many {big} is {n * f} {small}?"
        else:
            c = 5 * rng.randrange(-4, 9)
            text = rng.choice([f"Convert {c}°C to Fahrenheit.", f"What is {c} degrees Celsius in Fahrenheit?"])
        numeric = True
    else:
        seq = ", ".join(map(str, _sequence(rng)))
        text = rng.choice(
            [
                "What comes next in the sequence: {s}, ...?",
                "Find the next number: {s}, ?",
                "What is the next number in this pattern: {s}? Explain the rule.",
            ]
        ).format(s=seq)
        numeric = "rule" not in text
    if "Explain" in text:  # already asks for its reasoning
        return text
    return text + rng.choice(NUMERIC_TAILS if numeric else OTHER_TAILS)


# ---------------------------------------------------------------- code
FUNC_TASKS = _w("""reverse a string|sum a list of numbers|check whether a number is even|count the vowels in a string|
    find the largest number in a list|remove duplicates from a list while keeping the order|
    check whether a string is a palindrome|convert Celsius to Fahrenheit|compute the factorial of n|
    return the first n Fibonacci numbers|capitalise the first letter of every word in a sentence|
    count how often each word appears in a text|flatten a list of lists|check whether a year is a leap year|
    compute the average of a list of numbers|merge two sorted lists into one sorted list|
    find the second largest number in a list|keep only the even numbers from a list|
    check whether two strings are anagrams|split a list into chunks of size n|count the words in a sentence|
    convert a number of seconds into hours, minutes and seconds|check whether a string contains only digits|
    find the most common element in a list|remove all whitespace from a string|
    return the items two lists have in common|
    generate a random password of a given length|check whether a number is prime|
    compute the greatest common divisor of two numbers|rotate a list by k positions|sort a list of words by length|
    return the longest word in a sentence|clamp a number between a minimum and a maximum|
    convert a binary string to an integer|truncate a string to a given length and add '...'|
    compute the sum of the digits of a number|count the uppercase letters in a string|
    format a number with thousands separators|return the file extension of a file name""")
LANGS = ["Python", "Python", "JavaScript"]
SQL_TABLES = [
    (
        "customers(id, name, city, signup_date)",
        _w("""list all customers from Lyon|count the customers in each city|
        find the customers who signed up in 2024|return the ten most recent sign-ups"""),
    ),
    (
        "orders(id, customer_id, total, created_at)",
        _w("""find the total sales per customer|list orders over 100 dollars|
        find the average order value|count the orders placed each month"""),
    ),
    (
        "employees(id, name, department, salary)",
        _w("""find the highest-paid employee in each department|
        compute the average salary per department|list employees earning more than 50000, highest first|
        count how many employees each department has"""),
    ),
    (
        "products(id, name, category, price, stock)",
        _w("""list the products that are out of stock|
        find the five most expensive products|count the products in each category|
        raise the price of every product in the 'books' category by 10%"""),
    ),
    (
        "students(id, name, grade, score)",
        _w("""find the average score per grade|list the top three students by score|
        find the students whose score is below the overall average"""),
    ),
    (
        "books(id, title, author, year)",
        _w("""list the books published before 1950|
        count how many books each author has written|find titles that appear more than once"""),
    ),
]
BASH_TASKS = _w("""count the lines in a file called data.txt|
    find all .log files in the current directory and its subfolders|
    rename every .jpeg file in a folder to .jpg|list the ten largest files in a directory|
    replace 'foo' with 'bar' in every .txt file in a folder|show how much disk space the current folder uses|
    list the files modified in the last 24 hours|make a backup copy of a folder with today's date in its name|
    count how many times the word 'error' appears in a log file|print the first line of every .csv file in a folder|
    download a file from a URL|check whether a file exists before reading it|print the numbers from 1 to 10|
    delete empty directories under the current folder|show the processes using the most memory|
    extract a .tar.gz archive into a given folder|sort a file's lines and remove duplicates|
    print the third column of a comma-separated file|zip all .txt files in a folder into one archive|
    print today's date in YYYY-MM-DD format""")
SNIPPETS = [
    "def f(xs):\n    return [x * 2 for x in xs if x > 0]",
    "print(sorted(set(words), key=len))",
    "const total = items.reduce((sum, x) => sum + x.price, 0);",
    "for i in range(1, 11):\n    print(i, i * i)",
    "SELECT city, COUNT(*) FROM customers GROUP BY city;",
    "ls -1 | wc -l",
    "words = text.split()\ncounts = {w: words.count(w) for w in set(words)}",
    "const evens = nums.filter(n => n % 2 === 0);",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "name = input('Name: ')\nprint(f'Hello, {name}!')",
    "grep -c 'ERROR' app.log",
    "const unique = [...new Set(list)];",
]
BUGGY = [
    "def average(xs):\n    return sum(xs) / len(xs) + 1",
    "def is_even(n):\n    return n % 2 == 1",
    "for i in range(10)\n    print(i)",
    "function add(a, b) {\n  return a - b;\n}",
    "def last(xs):\n    return xs[len(xs)]",
    "SELECT name, COUNT(*) FROM employees;",
    "if x = 5:\n    print('five')",
    "const nums = [3, 1, 2];\nnums.sort();\nconsole.log(nums[3]);",
    "def greet(name):\n    print('Hello, ' + name)\n\nmessage = greet('Ana')\nprint(message.upper())",
    "total = 0\nfor n in [1, 2, 3]:\ntotal += n",
]


def gen_code(rng: random.Random) -> str:
    kind = rng.randrange(6)
    if kind <= 2:
        t = rng.choice(
            [
                "Write a {l} function to {t}.",
                "Write a short {l} function to {t}, with a comment.",
                "How do I {t} in {l}?",
                "Show me how to {t} in {l}. Keep the code short.",
                "Write a {l} function to {t} and include one example call.",
                "Give me a {l} one-liner to {t}, if possible.",
                "Write a {l} function to {t}. Explain it in one sentence.",
                "What is the simplest way to {t} in {l}?",
            ]
        )
        return t.format(l=rng.choice(LANGS), t=rng.choice(FUNC_TASKS))
    if kind == 3:
        table, tasks = rng.choice(SQL_TABLES)
        t = rng.choice(
            [
                "Given a table {tb}, write a SQL query to {q}.",
                "Write a SQL query to {q}. The table is {tb}.",
                "I have a table {tb}. How do I {q} in SQL?",
            ]
        )
        return t.format(tb=table, q=rng.choice(tasks))
    if kind == 4:
        t = rng.choice(
            [
                "Write a bash command to {t}.",
                "How do I {t} from the command line?",
                "Give me a bash one-liner to {t}.",
                "Write a short bash script to {t}.",
            ]
        )
        return t.format(t=rng.choice(BASH_TASKS))
    if rng.random() < 0.5:
        t = rng.choice(
            [
                "What does this code do?\n\n{c}",
                "Explain this code line by line:\n\n{c}",
                "Explain in one sentence what this code does:\n\n{c}",
            ]
        )
        return t.format(c=rng.choice(SNIPPETS))
    t = rng.choice(
        [
            "Find the bug in this code:\n\n{c}",
            "This code doesn't work as expected. What is wrong?\n\n{c}",
            "Fix this code and explain the fix briefly:\n\n{c}",
        ]
    )
    return t.format(c=rng.choice(BUGGY))


# ---------------------------------------------------------------- advice
GOALS = _w("""sleep better|stay focused while studying|prepare for a job interview|save money on groceries|
    keep my houseplants alive|learn to cook simple meals|train for my first 5K run|travel on a tight budget|
    make a long flight more comfortable|write clearer emails|spend less time on my phone|stay motivated to exercise|
    give a better presentation|make friends in a new city|keep my desk tidy|learn a new language faster|
    manage a small team|negotiate a higher salary|stop procrastinating|study for a maths exam|
    pack light for a week-long trip|stick to a monthly budget|start a small vegetable garden|
    take better photos with my phone|drink more water during the day|write a strong CV|
    work from home without feeling isolated|wake up earlier|read more books|eat more vegetables|
    stay calm before exams|get better at public speaking|plan my week|save for a holiday|keep my laptop running fast|
    look after a new puppy|make my mornings less rushed|learn to touch type|remember people's names|cut down on sugar|
    run better meetings|give useful feedback to a colleague""")
SITUATIONS = _w("""My coworker keeps interrupting me in meetings|My laptop has become very slow|
    My sourdough starter smells strange|I have three deadlines on the same day|
    My neighbour plays loud music late at night|I get nervous before phone calls|
    My houseplant's leaves are turning yellow|I keep forgetting to reply to messages|My team doesn't read my emails|
    I have a job offer but I'm not sure about the salary|My bike chain keeps falling off|
    I can't fall asleep after using my phone at night|My kids won't eat vegetables|
    I have a six-hour layover in an airport I don't know|My friend always cancels plans at the last minute|
    I lost my passport two days before a trip|My manager gives vague feedback|I feel tired every afternoon at work|
    My cat scratches the sofa|I spilled coffee on my keyboard|I have an exam in three days and haven't started|
    My flatmate never does the dishes""")


def gen_advice(rng: random.Random) -> str:
    if rng.random() < 0.7:
        t = rng.choice(
            [
                "Give me {n} tips to {g}.",
                "What are some tips to help me {g}?",
                "How can I {g}?{T}",
                "What's the best way to {g}?{T}",
                "I want to {g}. Where should I start?",
                "What should I avoid if I want to {g}?",
                "Give me one practical piece of advice to {g}.",
                "I've tried and failed to {g}. What could I do differently?",
                "Suggest a simple weekly plan to {g}.",
                "List {n} beginner-friendly ways to {g}.",
            ]
        )
        return fill(rng, t, n=rng.choice(NUMBERS + ["a few"]), g=rng.choice(GOALS))
    s = rng.choice(SITUATIONS)
    t = rng.choice(
        [
            "{s}. What should I do?",
            "{s}. Any advice?",
            "{s}. What are my options?{T}",
            "{s}. How should I handle it?{T}",
            "Quick question: {sl}. What would you do?",
        ]
    )
    return fill(rng, t, s=s, sl=s if s.startswith("I ") else s[0].lower() + s[1:])


# ---------------------------------------------------------------- compare
CHOICES = [
    tuple(p.split(":"))
    for p in _w("""tea:coffee|renting a home:buying a home|Python:JavaScript as a first language|
    e-books:printed books|working from home:working in an office|a debit card:a credit card|
    a laptop:a desktop computer|an electric car:a petrol car|solar power:wind power|a hostel:a hotel|
    a backpack:a suitcase|studying alone:studying in a group|a morning workout:an evening workout|
    freelancing:a full-time job|taking the train:flying for a 500 km trip|walking:running for everyday fitness|
    a gas stove:an induction hob|a kayak:a canoe|a cat:a dog as a pet|paper notes:a note-taking app|
    a city break:a beach holiday|public transport:driving to work|a gym membership:working out at home|
    a tablet:a laptop for a student""")
]
CONTRASTS = [
    tuple(p.split(":"))
    for p in _w("""weather:climate|a virus:a bacterium|baking soda:baking powder|stocks:bonds|
    HTTP:HTTPS|RAM:storage|an alligator:a crocodile|a simile:a metaphor|"affect":"effect"|a hurricane:a tornado|
    mitosis:meiosis|speed:velocity|a CV:a cover letter|a frog:a toad|a cold:the flu|latitude:longitude|
    a rabbit:a hare|nuclear fission:nuclear fusion|a republic:a monarchy|a sea:an ocean|weight:mass|Git:GitHub|
    a compiler:an interpreter|a list:a tuple in Python|let:const in JavaScript|an app:a website|a butterfly:a moth|
    an epidemic:a pandemic|a hypothesis:a theory|"its":"it's"|a planet:a star|a herb:a spice|stock:broth|
    a lake:a pond|a dialect:a language|a loan:a grant|revenue:profit|a meteor:a meteorite|
    an allergy:an intolerance|a fruit:a vegetable|an emigrant:an immigrant|a mountain:a hill""")
]


def gen_compare(rng: random.Random) -> str:
    if rng.random() < 0.45:
        a, b = rng.choice(CHOICES)
        t = rng.choice(
            [
                "Should I choose {a} or {b}? Give me the key trade-offs.",
                "{A} vs. {b}: which is better, and when?",
                "What are the pros and cons of {a} compared with {b}?{T}",
                "Compare {a} and {b}{L}.",
                "Help me decide between {a} and {b}.",
                "Make a short table comparing {a} and {b}.",
            ]
        )
    else:
        a, b = rng.choice(CONTRASTS)
        t = rng.choice(
            [
                "What is the difference between {a} and {b}?{T}",
                "Compare {a} and {b}{L}.",
                "How is {a} different from {b}?{T}",
                "Give one similarity and one difference between {a} and {b}.",
                "Explain the difference between {a} and {b} with an example.",
                "People often confuse {a} and {b}. How can I tell them apart?{T}",
                "{A} vs. {b}: what's the difference?{T}",
            ]
        )
    return fill(rng, t, a=a, b=b, A=cap(a))


# ---------------------------------------------------------------- facts
COUNTRIES = _w("""France|Japan|Brazil|Canada|Kenya|Australia|India|Mexico|Egypt|Norway|Argentina|Vietnam|Morocco|
    Peru|Italy|South Korea|Ghana|New Zealand|Turkey|Portugal|Chile|Thailand|Poland|Ireland|Indonesia|Nigeria|Greece|
    Iceland|Colombia|Spain|Germany|Sweden|Ethiopia|Cuba|Nepal|Switzerland|Mongolia|Tanzania|Finland|Jordan""")
FAMOUS = _w("""Marie Curie|Leonardo da Vinci|Ada Lovelace|Nelson Mandela|Isaac Newton|Cleopatra|Galileo Galilei|
    Frida Kahlo|Mahatma Gandhi|Charles Darwin|Florence Nightingale|Genghis Khan|Wolfgang Amadeus Mozart|Rosa Parks|
    Albert Einstein|William Shakespeare|Alan Turing|Confucius|Amelia Earhart|Nikola Tesla|Jane Austen|
    Martin Luther King Jr.|Napoleon Bonaparte|Hypatia|Ibn Battuta|Rachel Carson|Louis Pasteur|Queen Victoria|
    Julius Caesar|Harriet Tubman|Katherine Johnson|Johannes Gutenberg""")
ANIMALS = _w("""elephants|penguins|octopuses|honeybees|koalas|wolves|dolphins|owls|camels|sea turtles|giraffes|bats|
    ants|polar bears|hummingbirds|sharks|chameleons|kangaroos|salmon|crows|jellyfish|tigers|beavers|flamingos|sloths""")
FACT_QUESTIONS = {
    "science": _w("""How far is the Moon from Earth?|What is the boiling point of water at sea level?|
        How many bones are in the adult human body?|What is the speed of light?|What are the three states of matter?|
        What is the largest planet in our solar system?|How do magnets attract metal?|What causes thunder?|
        What is the chemical formula for water?|Why do we have leap years?|Roughly how old is the universe?|
        What is an atom made of?|What is the difference between an element and a compound?|
        What gas do plants absorb from the air?|What is the hottest planet in the solar system?|What is DNA?|
        How many hearts does an octopus have?|Why is Mars red?|What is absolute zero?|
        How do bats find their way in the dark?"""),
    "geography": _w("""What is the longest river in the world?|What is the highest mountain in Africa?|
        Which is the largest desert in the world?|What causes deserts to form?|How many continents are there?|
        What is the deepest ocean?|What is the equator?|Why are there different time zones?|What is a fjord?|
        What is the smallest country in the world?|What is the Ring of Fire?|
        Which countries does the Amazon River flow through?|Why is the Dead Sea so salty?|What is an archipelago?"""),
    "history": _w("""When did the first Moon landing happen?|When did the Berlin Wall fall?|
        Who invented the printing press?|What was the Industrial Revolution?|Why did the Western Roman Empire fall?|
        What was the Silk Road?|When did World War II end?|Who built the pyramids of Giza?|What was the Renaissance?|
        What was the Cold War?|When was the World Wide Web invented?|What were the main causes of World War I?|
        Who led the first voyage around the world?|Why is the Magna Carta important?|What was the Great Fire of London?|
        What was the Ottoman Empire?|Why was the Great Wall of China built?|What was the Apollo program?"""),
    "cooking": _w("""How do I know when pasta is al dente?|Can I freeze cooked rice?|
        What can I use instead of eggs in baking?|How long should I boil an egg for a runny yolk?|
        What is the difference between simmering and boiling?|How do I stop my rice from getting sticky?|
        Why do recipes say to rest meat after cooking?|How do I make a basic vinaigrette?|
        What does it mean to fold ingredients together?|How can I tell if an avocado is ripe?|
        What is the best way to store fresh herbs?|Why did my cake sink in the middle?|How do I cook dried lentils?|
        How can I make a sauce thicker?|What are the five mother sauces of French cooking?|
        Why do onions turn sweet when cooked slowly?|How long does homemade soup keep in the fridge?|
        What is a roux?"""),
    "health": _w("""How much water should an adult drink each day?|Why is sleep important for health?|
        How much exercise do adults need per week?|What are the benefits of stretching?|
        What does vitamin D do in the body?|How can I tell a cold from the flu?|Why is washing your hands important?|
        What is a normal resting heart rate?|Is it bad to sit all day?|What foods are high in fibre?|
        How does caffeine affect the body?|What are the signs of dehydration?|Why warm up before exercise?|
        How does sunscreen protect the skin?|Why do we get muscle cramps?|What are good sources of iron?|
        How does stress affect sleep?"""),
    "travel": _w("""What should I pack for a week in a cold city?|
        How early should I arrive at the airport for an international flight?|What is jet lag and how can I reduce it?|
        What should I do if I miss a connecting flight?|Is travel insurance worth it?|
        How can I avoid getting sick while travelling?|What is the best way to carry money abroad?|
        How do I find cheap flights?|What documents do I usually need for international travel?|
        How can I stay safe in a city I don't know?|What is the difference between a visa and a passport?|
        How can I get by when I don't speak the local language?|Why do my ears hurt when a plane lands?|
        Is it better to book a hotel in advance or on arrival?"""),
    "work": _w("""What does a project manager do?|How do I write a good meeting agenda?|What is a performance review?|
        What should I include in a weekly status update?|What is the difference between a salary and an hourly wage?|
        What does a data analyst do?|How do I ask my manager for feedback?|What is a notice period?|
        What is a one-on-one meeting for?|How long should a cover letter be?|What is professional networking?|
        What is burnout?|What are soft skills?|What does a UX designer do?|What is a KPI?|
        What should I do in my first week at a new job?"""),
    "study": _w("""What is the Pomodoro technique?|How does spaced repetition work?|What is active recall?|
        How should I take notes in a lecture?|How many hours a day should I study?|
        Is it better to study in the morning or at night?|How can I memorise vocabulary faster?|
        What is the Feynman technique?|How do I write a good thesis statement?|How do I cite a website in an essay?|
        What is a literature review?|How can I read a textbook more effectively?|
        What is the difference between a primary and a secondary source?|How do I prepare for an open-book exam?|
        What is a mind map?"""),
}
FACT_DOMAINS = list(FACT_QUESTIONS)


def gen_facts(rng: random.Random) -> str:
    # about half from the templated subjects (countries, people, animals), half from the fixed questions
    kind = rng.randrange(3) if rng.random() < 0.45 else 3 + rng.randrange(len(FACT_DOMAINS))
    if kind == 0:
        t = rng.choice(
            [
                "What is the capital of {c}?",
                "What is {c} famous for?{T}",
                "What languages are spoken in {c}?",
                "What is the climate like in {c}?{T}",
                "What is a traditional dish from {c}?",
                "Tell me three interesting facts about {c}.",
                "What should a first-time visitor to {c} know?{T}",
                "What currency is used in {c}?",
                "Describe the geography of {c}{L}.",
            ]
        )
        return fill(rng, t, c=rng.choice(COUNTRIES))
    if kind == 1:
        t = rng.choice(
            [
                "Who was {p}?{T}",
                "What is {p} best known for?{T}",
                "Tell me about {p}{L}.",
                "Give me two interesting facts about {p}.",
                "Why is {p} important in history?{T}",
                "Summarise the life of {p} in three sentences.",
            ]
        )
        return fill(rng, t, p=rng.choice(FAMOUS))
    if kind == 2:
        t = rng.choice(
            [
                "How long do {a} live?",
                "What do {a} eat?{T}",
                "Where do {a} live in the wild?",
                "How do {a} communicate?{T}",
                "Tell me a surprising fact about {a}.",
                "How do {a} raise their young?{T}",
                "Are {a} endangered?{T}",
            ]
        )
        return fill(rng, t, a=rng.choice(ANIMALS))
    return rng.choice(FACT_QUESTIONS[FACT_DOMAINS[kind - 3]]) + tail(rng, 0.5, 0.25)


# ---------------------------------------------------------------- classification and extraction
WORD_GROUPS = [  # (singular with article, plural, members)
    ("a fruit", "fruits", _w("apple|banana|mango|cherry|pear|kiwi|plum|apricot|grape|pineapple|peach|lemon")),
    ("a vegetable", "vegetables", _w("carrot|broccoli|spinach|onion|cabbage|lettuce|celery|leek|potato|radish")),
    ("an animal", "animals", _w("tiger|rabbit|eagle|dolphin|horse|frog|lizard|fox|whale|owl")),
    ("a tool", "tools", _w("hammer|screwdriver|wrench|saw|drill|chisel|pliers|shovel")),
    ("a colour", "colours", _w("red|turquoise|violet|amber|crimson|beige|teal|indigo")),
    ("a musical instrument", "musical instruments", _w("violin|trumpet|piano|flute|drum|cello|harp|saxophone")),
    ("a vehicle", "vehicles", _w("bicycle|truck|canoe|tram|helicopter|scooter|ferry|van")),
    ("a piece of furniture", "pieces of furniture", _w("sofa|wardrobe|bookshelf|armchair|desk|stool|dresser")),
    ("a sport", "sports", _w("tennis|rugby|cycling|volleyball|badminton|fencing|rowing")),
    ("a metal", "metals", _w("copper|iron|silver|zinc|aluminium|tin|nickel")),
    ("a country", "countries", _w("Peru|Norway|Kenya|Japan|Chile|Poland|Egypt|Canada")),
]
REVIEW_ITEMS = _w("""the blender|this phone case|the hotel room|the new album|this backpack|the restaurant's pasta|
    the coffee maker|these headphones|the tour guide|this novel""")
VERDICTS = {
    "positive": _w(
        "was absolutely wonderful|worked perfectly from day one|exceeded my expectations|is worth every penny|"
        "made my week"
    ),
    "negative": _w(
        "stopped working after two days|was a total waste of money|arrived broken|was much worse than described|"
        "was a big disappointment"
    ),
    "mixed": _w(
        "looks nice but is quite noisy|was cheap, but it did not last long|does the job, nothing special|"
        "was fine, I suppose"
    ),
}
HEADLINES = {
    "sports": _w("""Local runner breaks the city marathon record|Underdogs win the cup final on penalties|
        Tennis star announces retirement at 34|Swimming team qualifies for the world championships"""),
    "technology": _w("""New phone battery charges fully in five minutes|
        Start-up launches an app that translates sign language|
        Major website suffers a six-hour outage|Researchers unveil a faster chip for laptops"""),
    "food": _w("""Chef opens a restaurant that serves only soup|Bakery sells out of croissants before 8 a.m.|
        Survey finds the city's favourite pizza topping|Street food festival returns this weekend"""),
    "science": _w("""Astronomers spot a new comet near Jupiter|Scientists discover a deep-sea fish that glows green|
        New fossil shows dinosaurs had feathers|Ice core reveals climate of 800,000 years ago"""),
    "business": _w("""Local factory hires 300 new workers|Coffee chain raises prices for the second time this year|
        Shares rise after record quarterly profits|Small bookshop doubles sales with online orders"""),
}
SENTENCE_TYPES = _w("""Close the window before you leave.|Did you water the plants?|The train leaves at six.|
    Please send me the report by Friday.|Where did you park the car?|The museum is free on Sundays.|
    Turn left at the next corner.|Have you ever been to Lisbon?|It rained all weekend.|Don't forget your umbrella.|
    Why is the printer making that noise?|My sister works as a nurse.""")
CITIES = _w("Lisbon|Nairobi|Toronto|Osaka|Lima|Krakow|Melbourne|Cairo|Oslo|Hanoi|Dublin|Seville")


def _number_sentence(rng: random.Random) -> str:
    r = rng.randrange
    return rng.choice(
        [
            f"The shop sold {r(5, 90)} apples, {r(5, 90)} pears and {r(2, 30)} melons on {rng.choice(WEEKDAYS)}.",
            f"Our flight leaves at {r(6, 12)}:{r(10, 60)} from gate {r(1, 40)}, and the trip takes {r(2, 14)} hours.",
            f"The recipe needs {r(2, 6)} eggs, {25 * r(4, 16)} grams of sugar and {50 * r(2, 10)} millilitres of milk.",
            f"In {r(1950, 2024)}, the town had {r(2000, 90000)} residents and {r(2, 30)} schools.",
            (
                f"{rng.choice(PEOPLE_NAMES)} ran {r(3, 22)} kilometres in {r(20, 140)} minutes and burned about "
                f"{10 * r(20, 120)} calories."
            ),
            (
                f"The invoice lists {r(2, 12)} chairs at {r(20, 90)} dollars each and a delivery fee of "
                f"{r(5, 40)} dollars."
            ),
        ]
    )


def gen_classify(rng: random.Random) -> str:
    kind = rng.randrange(9)
    if kind <= 2:
        groups = rng.sample(WORD_GROUPS, 4)
        if kind == 0:
            words = [rng.choice(g[2]) for g in groups]
            rng.shuffle(words)
            t = rng.choice(
                [
                    "Which of these words is {g}: {w}?",
                    "Pick out {g} from this list: {w}.",
                    "Only one of these is {g}. Which one? {w}",
                ]
            )
            return t.format(g=groups[0][0], w=", ".join(words))
        if kind == 1:
            words = rng.sample(groups[0][2], 3) + [rng.choice(groups[1][2])]
            rng.shuffle(words)
            t = rng.choice(
                [
                    "Which word is the odd one out: {w}? Explain why.",
                    "Find the word that doesn't belong: {w}.",
                    "One of these words doesn't fit with the others: {w}. Which one, and why?",
                ]
            )
            return t.format(w=", ".join(words))
        words = rng.sample(groups[0][2], 3) + rng.sample(groups[1][2], 3)
        rng.shuffle(words)
        t = rng.choice(
            [
                "Sort these words into {a} and {b}: {w}.",
                "Group these words into {a} and {b}: {w}.",
                "Group the following words into two categories and name each group: {w}.",
            ]
        )
        return t.format(a=groups[0][1], b=groups[1][1], w=", ".join(words))
    if kind == 3:
        t = rng.choice(
            [
                'Extract the numbers from: "{s}"',
                'List every number in this sentence: "{s}"',
                'Pull out all the numbers from this text and tell me which one is largest: "{s}"',
            ]
        )
        return t.format(s=_number_sentence(rng))
    if kind == 4:
        a, b = rng.sample(PEOPLE_NAMES, 2)
        c1, c2 = rng.sample(CITIES, 2)
        s = rng.choice(
            [
                f"{a} met {b} in {c1} on {rng.choice(WEEKDAYS)} to plan their trip to {c2}.",
                f"After living in {c1} for years, {a} moved to {c2}, where {b} runs a small bakery.",
                f"{a} emailed {b} from {c1} to say the conference in {c2} had been moved to {rng.choice(MONTHS)}.",
            ]
        )
        t = rng.choice(
            [
                'Extract the people and places mentioned in this sentence: "{s}"',
                'Which cities are mentioned in this text? "{s}"',
                'Return the names of the people in this text as a JSON list: "{s}"',
            ]
        )
        return t.format(s=s)
    if kind == 5:
        m1, m2 = rng.sample(MONTHS, 2)
        d1, d2, y = rng.randrange(1, 29), rng.randrange(1, 29), rng.randrange(2019, 2027)
        a, b = rng.sample(PEOPLE_NAMES, 2)
        if rng.random() < 0.4:
            s = f"The contract starts on {m1} {d1}, {y} and ends on {m2} {d2}, {y + 1}."
            t = rng.choice(
                [
                    'Extract all dates from this text: "{s}"',
                    'Rewrite the dates in this sentence in YYYY-MM-DD format: "{s}"',
                ]
            )
            return t.format(s=s)
        s = rng.choice(
            [
                f"Contact {a} at {a.lower()}@example.com or {b} at {b.lower()}.office@example.org before {m1} {d1}.",
                f"The workshop on {m1} {d1} is full, so {a} booked the one on {m2} {d2}.",
            ]
        )
        t = rng.choice(
            [
                'Extract all dates from this text: "{s}"',
                'Extract any dates, names and email addresses from: "{s}"',
                'Return the names and dates in this text as JSON: "{s}"',
            ]
        )
        return t.format(s=s)
    if kind == 6:
        mood = rng.choice(list(VERDICTS))
        review = f"{cap(rng.choice(REVIEW_ITEMS))} {rng.choice(VERDICTS[mood])}."
        t = rng.choice(
            [
                'Is this review positive, negative or neutral? "{r}"',
                'Classify the sentiment of this review: "{r}"',
                'What is the sentiment of the following review? Answer with one word. "{r}"',
            ]
        )
        return t.format(r=review)
    if kind == 7:
        topics = list(HEADLINES)
        h = rng.choice(HEADLINES[rng.choice(topics)])
        rng.shuffle(topics)
        return rng.choice(
            ['Classify this headline as {o}: "{h}"', 'Which topic fits this headline best ({o})? "{h}"']
        ).format(o=", ".join(topics[:-1]) + " or " + topics[-1], h=h)
    s = rng.choice(SENTENCE_TYPES)
    return rng.choice(
        [
            'Is this sentence a question, a command or a statement? "{s}"',
            'Classify this sentence as a question, command or statement: "{s}"',
        ]
    ).format(s=s)


# ---------------------------------------------------------------- language (no translation)
SYNONYM_WORDS = _w("""happy|big|fast|smart|tired|angry|beautiful|difficult|quiet|brave|funny|important|strange|cold|
    rich|begin|help|look|say|walk|buy|calm|honest|tiny|old|bright|kind|boring|delicious|easy""")
ANTONYM_WORDS = _w("""hot|generous|ancient|victory|increase|arrive|optimistic|expand|visible|strong|accept|shallow|
    include|rare|cheap|polite|temporary|forget|heavy|early|fail|noisy|simple|guilty|love|above|success|maximum""")
RHYME_WORDS = _w("cat|light|day|blue|moon|tree|rain|star|heart|sing|bold|fire|cake|snow|time|sea|dream|town|cloud|bear")
PLURALS = _w("""mouse|child|cactus|goose|person|tooth|knife|sheep|analysis|criterion|leaf|ox|phenomenon|fungus|woman|
    potato|hero|deer|fish|wife|half|crisis|thesis|radius|index|tomato|foot|bus|box|city|baby|key|echo|moose|man|
    octopus|appendix|volcano|species""")
IRREGULAR_VERBS = _w("""go|swim|bring|catch|teach|think|fly|run|write|begin|choose|freeze|lead|seek|shake|sing|sink|
    steal|wake|weave|dig|bite|hide|ride|lend""")
MISSPELT = [
    ("definitely", "definately"),
    ("separate", "seperate"),
    ("necessary", "neccessary"),
    ("receive", "recieve"),
    ("occasion", "occassion"),
    ("accommodate", "accomodate"),
    ("embarrass", "embarass"),
    ("calendar", "calender"),
    ("tomorrow", "tommorow"),
    ("beginning", "begining"),
    ("rhythm", "rythm"),
    ("weird", "wierd"),
    ("government", "goverment"),
    ("restaurant", "restaraunt"),
]
POS = [
    ("run", "I go for a run every morning."),
    ("run", "They run every morning."),
    ("light", "Turn on the light."),
    ("light", "The bag is light."),
    ("fast", "She runs fast."),
    ("fast", "They fast during the day."),
    ("book", "Please book a table for two."),
    ("book", "I finished the book."),
    ("well", "She sings well."),
    ("well", "The well was deep."),
    ("back", "Come back soon."),
    ("back", "My back hurts."),
    ("present", "She will present the results."),
    ("present", "I bought a present for him."),
]
FORMS = [
    ("adjective form", "noun", _w("beauty|danger|nature|fame|success|care|hope|friend|music|courage")),
    ("adverb form", "adjective", _w("quick|happy|careful|gentle|easy|quiet|angry|honest|true|simple")),
    ("noun form", "verb", _w("decide|explain|arrive|grow|refuse|succeed|describe|choose|fail|deliver")),
]


def gen_language(rng: random.Random) -> str:
    kind = rng.randrange(10)
    n = rng.choice(NUMBERS)
    if kind == 0:
        t = rng.choice(
            [
                "Give me {n} synonyms for '{w}'.",
                "What is another word for '{w}'?",
                "List {n} synonyms for '{w}', from most to least formal.",
                "Suggest a more vivid word than '{w}' for a story.",
            ]
        )
        return t.format(n=n, w=rng.choice(SYNONYM_WORDS))
    if kind == 1:
        t = rng.choice(
            [
                "What is the opposite of '{w}'?",
                "Give an antonym for '{w}'.",
                "Write a sentence that uses '{w}' and its opposite.",
                "List {n} antonyms of '{w}'.",
            ]
        )
        return t.format(n=n, w=rng.choice(ANTONYM_WORDS))
    if kind == 2:
        t = rng.choice(
            [
                "List {n} words that rhyme with '{w}'.",
                "What words rhyme with '{w}'?",
                "Write a short couplet that ends with a word rhyming with '{w}'.",
            ]
        )
        return t.format(n=n, w=rng.choice(RHYME_WORDS))
    if kind == 3:
        if rng.random() < 0.5:
            t = rng.choice(
                ["What is the plural of '{w}'?", "Is the plural of '{w}' regular or irregular? Give the plural."]
            )
            return t.format(w=rng.choice(PLURALS))
        return "Write the plural forms of these nouns: {}.".format(", ".join(rng.sample(PLURALS, rng.randrange(3, 6))))
    if kind == 4:
        t = rng.choice(
            [
                "What is the past tense of '{v}'?",
                "Give the past tense and past participle of '{v}'.",
                "Use the past tense of '{v}' in a sentence.",
            ]
        )
        return t.format(v=rng.choice(IRREGULAR_VERBS))
    if kind == 5:
        words = [rng.choice(g[2]) for g in rng.sample(WORD_GROUPS, rng.randrange(5, 8))]
        return rng.choice(
            ["Put these words in alphabetical order: {w}.", "Sort these words alphabetically: {w}."]
        ).format(w=", ".join(words))
    if kind == 6:
        a, b = rng.sample(VOCAB, 2)
        return rng.choice(
            [
                f"Use the word '{a}' in a sentence.",
                f"Write one sentence that uses both '{a}' and '{b}'.",
                f"How many syllables are in the word '{a}'?",
            ]
        )
    if kind == 7:
        w, s = rng.choice(POS)
        return rng.choice(
            [
                f"What part of speech is '{w}' in this sentence: \"{s}\"?",
                f"In \"{s}\", is '{w}' a noun, a verb, an adjective or an adverb?",
            ]
        )
    if kind == 8:
        what, of, words = rng.choice(FORMS)
        return f"What is the {what} of the {of} '{rng.choice(words)}'?"
    good, bad = rng.choice(MISSPELT)
    pair = [good, bad] if rng.random() < 0.5 else [bad, good]
    return rng.choice(["Which is spelled correctly: '{}' or '{}'?", "Which spelling is right, '{}' or '{}'?"]).format(
        *pair
    )


# ---------------------------------------------------------------- multi-turn follow-ups
FOLLOW_UPS = {
    "explain": _w("""Can you make it shorter?|Give me an example.|Explain it like I'm five.|
        Can you put that in a bulleted list?|
        What is a common misconception about this?|Can you go into a bit more detail?|
        How would you explain it with an analogy?"""),
    "definition": _w("""Give me an example.|Use it in a sentence.|How is it used in practice?|Can you make it simpler?|
        Where does the word come from?|Is there a related term I should know?"""),
    "list": _w("""Add two more.|Which one is the best, and why?|Sort them alphabetically.|
        Can you explain the first one in more detail?|Make the list shorter.|
        Turn that into a numbered list with one sentence each."""),
    "writing": _w("""Make it funnier.|Now make it rhyme.|Can you give it a title?|Rewrite it in a more serious tone.|
        Make it shorter.|Write another version.|Can you make it more formal?|Make it sound more cheerful."""),
    "rewrite": _w("""Make it even shorter.|Can you give me another version?|Why did you change it that way?|
        Now make it sound friendlier.|Make it more formal."""),
    "reasoning": _w("""How did you get that?|Can you check your answer?|Explain it step by step.|
        Is there a quicker way to work it out?|Can you write a similar problem for me to try?"""),
    "code": _w("""Can you add comments?|How would I test it?|What is its time complexity?|
        Can you make it handle empty input?|
        Can you explain it line by line?|Is there a shorter way to write it?|What could go wrong with it?"""),
    "advice": _w("""Which of these is most important?|Can you expand on the second point?|
        What if I only have ten minutes a day?|
        Give me a concrete first step for today.|What mistakes should I avoid?|Make it a short checklist."""),
    "compare": _w("""Summarise that in one sentence.|Make it a table.|Give me an example of each.|
        What do they have in common?|Can you make it shorter?|Explain it more simply."""),
    "facts": _w("""Tell me one more interesting fact.|Where can I learn more about this?|
        Can you say that in simpler words?|
        Why is that?|Can you give me more detail?|How do we know that?"""),
    "language": _w("""Give me more examples.|Can you use that in a sentence?|Are there any exceptions?|
        Can you explain the rule?|Give me a few more."""),
}
GENERIC_FOLLOW_UPS = _w("""Thanks! Can you make it shorter?|Can you say that more simply?|Give me an example.|
    Can you summarise that in one sentence?|Great, anything else I should know?""")


GENERATORS = {
    "explain": gen_explain,
    "definition": gen_definition,
    "list": gen_list,
    "writing": gen_writing,
    "rewrite": gen_rewrite,
    "reasoning": gen_reasoning,
    "code": gen_code,
    "advice": gen_advice,
    "compare": gen_compare,
    "facts": gen_facts,
    "classify": gen_classify,
    "language": gen_language,
}
CATEGORIES = list(GENERATORS) + ["multi_turn"]
PER_CATEGORY = 250  # unique prompts per single-turn category
MULTI_TURN = 340  # about 10% of the set


def make_record(category: str, rng: random.Random) -> dict:
    if category != "multi_turn":
        return {"messages": [{"role": "user", "content": GENERATORS[category](rng)}], "category": category}
    source = rng.choice(sorted(FOLLOW_UPS))
    first = GENERATORS[source](rng)
    pool = FOLLOW_UPS[source] + [f for f in GENERIC_FOLLOW_UPS if f not in FOLLOW_UPS[source]]
    follow = rng.sample(pool, 1 if rng.random() < 0.6 else 2)
    return {"messages": [{"role": "user", "content": first}], "follow_ups": follow, "category": "multi_turn"}


def _stream(seed: int, name: str) -> random.Random:
    """An independent random stream per (seed, name), stable across Python runs and hash seeds."""
    digest = hashlib.sha256(f"mars-prompts:{seed}:{name}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def build(seed: int = 0, test: int = 150, valid: int = 150) -> dict[str, list[dict]]:
    """All prompts, deduplicated on the normalised first user turn, shuffled and split.

    Raises ValueError when the unique prompts cannot fill test + valid and leave a train split."""
    if test < 0 or valid < 0:
        raise ValueError(f"split sizes must be >= 0 (test={test}, valid={valid})")
    targets = {c: PER_CATEGORY for c in GENERATORS} | {"multi_turn": MULTI_TURN}
    records, seen = [], set()
    for category, target in targets.items():
        rng, made, tries = _stream(seed, category), 0, 0
        while made < target and tries < 100 * target:
            tries += 1
            rec = make_record(category, rng)
            key = normalise(rec["messages"][0]["content"])
            if key in seen:
                continue
            seen.add(key)
            records.append(rec)
            made += 1
    if len(records) <= test + valid:
        raise ValueError(
            f"only {len(records)} unique prompts: cannot form test={test} and valid={valid} "
            f"and still leave a train split"
        )
    _stream(seed, "split").shuffle(records)
    return {"train": records[test + valid :], "valid": records[test : test + valid], "test": records[:test]}


def write(out_dir, splits: dict[str, list[dict]]) -> None:
    """One JSON object per line, UTF-8, '\\n' line endings: <out_dir>/<split>.jsonl."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in SPLITS:
        with open(out / f"{name}.jsonl", "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in splits[name])


def count_table(splits: dict[str, list[dict]]) -> dict[str, dict[str, int]]:
    """{category: {split: n}} in generation order."""
    return {c: {s: sum(r["category"] == c for r in splits[s]) for s in SPLITS} for c in CATEGORIES}


def write_readme(out_dir, splits: dict[str, list[dict]], seed: int) -> None:
    """<out_dir>/README.md: what the set is, how it was made, and its counts."""
    rows = [
        f"| {c} | " + " | ".join(str(row[s]) for s in SPLITS) + f" | {sum(row.values())} |"
        for c, row in count_table(splits).items()
    ]
    rows.append(
        "| **total** | " + " | ".join(str(len(splits[s])) for s in SPLITS) + f" | {sum(map(len, splits.values()))} |"
    )
    args = f"--seed {seed} --test {len(splits['test'])} --valid {len(splits['valid'])}"
    multi_turn_example = (
        '{"messages": [{"role": "user", "content": "..."}], "follow_ups": ["Give me an example."], '
        '"category": "multi_turn"}'
    )
    text = f"""# Instruction prompts

The project's own set of instruction prompts, for self-distillation (`mars distill --prompts
data/prompts`) and evaluation (`--prompts data/prompts/test.jsonl`). It has prompts only: the
assistant replies are generated later by the model itself.

No third-party dataset text: every prompt comes from the templates and word lists in
`scripts/make_prompts.py`.

## How it was made

    python scripts/make_prompts.py   # same as: {args}

Each category draws from its own random stream derived from the seed (**{seed}**). Prompts are
deduplicated on the normalised text (lowercase, collapsed whitespace) of the first user turn,
shuffled once, and cut into test, valid and the rest train, so the splits are disjoint and any
prefix of a file is a random sample across categories. The same seed gives byte-identical files.
This file is written by the script too.

## Format

One JSON object per line (UTF-8, `\\n` line endings):

    {{"messages": [{{"role": "user", "content": "..."}}], "category": "explain"}}
    {multi_turn_example}

`follow_ups` (multi-turn records only) holds 1 or 2 later user turns, each asked after the model's
reply to the previous one.

## Counts

| category | {" | ".join(SPLITS)} | total |
|---|{"---|" * len(SPLITS)}---|
{chr(10).join(rows)}

Categories: explanations (how/why), definitions, lists, short writing (poems, stories, slogans,
emails, tweets), rewriting of sentences the script composes (paraphrase, formal tone, grammar
fixes, summaries), reasoning and arithmetic (word problems, comparisons, unit conversions,
sequences), code (Python, JavaScript, SQL, bash), advice, comparisons, facts (science, geography,
history, cooking, health, travel, work, study, countries, people, animals), classification and
extraction, language tasks (synonyms, antonyms, rhymes, plurals, spelling), and multi-turn
follow-ups. Many prompts ask for a short answer ("in one sentence", "List three", "under 50
words"); others leave the length open or ask for detail.
"""
    Path(out_dir, "README.md").write_text(text, encoding="utf-8", newline="\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Write the project's instruction prompt set (train/valid/test JSONL).")
    ap.add_argument("--out", default="data/prompts", help="output directory (default: data/prompts)")
    ap.add_argument("--seed", type=int, default=0, help="random seed for generation and split (default: 0)")
    ap.add_argument("--test", type=int, default=150, help="prompts in test.jsonl (default: 150)")
    ap.add_argument("--valid", type=int, default=150, help="prompts in valid.jsonl (default: 150)")
    args = ap.parse_args(argv)
    try:
        splits = build(args.seed, args.test, args.valid)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    write(args.out, splits)
    write_readme(args.out, splits, args.seed)
    print(f"{'category':<12}" + "".join(f"{s:>7}" for s in SPLITS) + f"{'total':>7}")
    for c, row in count_table(splits).items():
        print(f"{c:<12}" + "".join(f"{row[s]:>7}" for s in SPLITS) + f"{sum(row.values()):>7}")
    print(f"{'total':<12}" + "".join(f"{len(splits[s]):>7}" for s in SPLITS) + f"{sum(map(len, splits.values())):>7}")
    print(f"wrote {', '.join(f'{s}.jsonl' for s in SPLITS)} and README.md to {args.out} (seed {args.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
