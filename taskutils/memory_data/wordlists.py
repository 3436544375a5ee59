"""Small built-in English word lists for NIAH keys, common-words extraction and synthetic QA.

RULER draws these from the ``wonderwords`` package; we ship our own short lists so nothing has to be
installed or downloaded. ``random_key_words`` combines them into "adjective-noun" keys
(``len(ADJECTIVES) * len(NOUNS)`` distinct keys).
"""

from __future__ import annotations

import random

ADJECTIVES: tuple[str, ...] = tuple(
    """
    able abrupt absent acidic active adorable agile airy alert alive amber ample ancient angry
    animated anxious aquatic arctic arid aromatic ashy austere autumn average awake awkward
    bald balmy bashful beige bitter black bland blind blue blunt bold bony bouncy brave breezy
    brief bright brisk broad bronze brown bumpy busy calm candid careful casual cheap cheerful
    chilly chubby civil clean clever cloudy clumsy coarse cold colossal comfy cool copper cosmic
    cozy crafty creamy crimson crisp crooked cruel crunchy cuddly curly curious cute damp dapper
    daring dark dazzling deep dense dizzy dreamy drowsy dry dull dusty eager early earthy easy
    elegant empty endless equal exotic faded faint fancy fast feisty fierce fiery filthy firm
    flaky flat fluffy foggy fond fragile frail frank free fresh friendly frosty frozen funny
    fuzzy gentle giant giddy gifted glad gleaming glossy golden graceful grand grassy gray greasy
    great green grumpy hairy handy happy hardy harsh hasty hazy healthy heavy hidden hollow honest
    humble hungry icy idle jagged jolly joyful juicy keen kind large late lavish lazy lean
    leafy legal level light lively lonely loud lovely loyal lucky lumpy lush magic majestic
    mellow merry messy mighty mild minty misty modern modest moist moody muddy musty narrow
    nasty neat nervous nimble noble noisy nutty obscure odd oily olive orange ornate pale
    patient peaceful perfect plain pleasant plump polite poor proud purple quaint quick quiet
    rapid rare ready regal rich rigid ripe rocky rosy rough round royal rusty sacred salty
    sandy scarlet secret serene shaggy shallow sharp shiny short shy silent silky silver simple
    sleepy slim slow small smart smoky smooth snowy soft solid sour spicy spiky spotty stale
    steady steep sticky stormy strange striped strong sturdy subtle sunny super sweet swift tall
    tame tangy tart tasty tender tense thick thin thirsty tidy tiny tired tough tricky tropical
    ugly unique upset urban vague valid vast velvet violet vivid wacky warm wary weary wet white
    wide wild windy wise witty wooden woolly worried yellow young zany zealous
    """.split()
)

NOUNS: tuple[str, ...] = tuple(
    """
    acorn actor airport album alley anchor angle ankle apple apron arch arena armor arrow artist
    atlas attic avenue badge bakery balcony ball balloon bamboo banana band banjo bank barn barrel
    basket bath beach beacon bean bear beard bed bee beetle bell belt bench berry bicycle bird
    blanket blossom boat bolt bone book boot bottle boulder bowl box bracelet branch bread breeze
    brick bridge brook broom bubble bucket buffalo bugle bull bunny butter button cabin cable
    cactus cake camel camera canal candle canoe canyon cap captain card carpet carrot castle cat
    cave cellar chair chalk channel cheese cherry chest chimney circle city cliff clock cloud
    clover coast coat cobra coconut coffee coin comet compass cookie copper coral corn cottage
    cotton cousin crane crayon creek cricket crow crown crystal cup curtain cushion daisy dancer
    desert desk diamond dinner dolphin donkey door dragon drawer dream drum duck eagle earth
    elbow elephant elm engine envelope eraser falcon fan farm feather fence fern ferry field fig
    finch fire fish flag flame flute fog forest fork fossil fountain fox frog garden garlic gate
    gem ghost giraffe glacier glass glove goat gong goose grape grass guitar hammer harbor harp
    hat hawk hazel helmet hill hive honey horizon horn horse hotel house island ivy jacket jade
    jar jelly jewel journey jungle kettle key kingdom kite kitten knight ladder lagoon lake lamp
    lantern lava leaf lemon letter library lily lion lizard lobster locket lotus magnet mango
    map maple marble market meadow melon mirror mitten monkey moon moose mountain mouse mushroom
    needle nest net night oak oasis ocean office olive onion orchard orchid otter owl oyster
    paddle palace panda paper parrot path peach pearl pebble pencil penguin pepper piano pickle
    pillow pine pipe planet plum pocket pond poppy potato puddle pumpkin puppet quail quartz
    queen quilt rabbit raccoon radio rain rainbow raven reef ribbon river road robin rocket roof
    rose ruby saddle sail salmon sandal saucer scarf school scroll seal shadow shark shell ship
    shoe shore silk skate sled snail snake sock sofa spider spoon spring squirrel stable star
    statue stone storm stream street sugar summit sun swan sweater table tablet tail teapot
    temple tent thistle thunder tiger toast tomato tower tractor train tree trumpet tulip tunnel
    turtle umbrella valley vase village violin volcano wagon wall walnut wand watch water wave
    whale wheat wheel whistle willow window wing winter wizard wolf wool yacht yard zebra zipper
    """.split()
)

VERBS: tuple[str, ...] = tuple(
    """
    accept add admire advise agree allow answer appear arrive ask bake balance bathe battle beg
    behave belong blink boil borrow bounce breathe brush build bump calculate call camp care carry
    carve cause change chase cheer chew clap clean climb collect comb compare complain connect
    copy count cover crawl cross crush cycle dance decide deliver describe dig divide drag dream
    drift drop dust earn educate empty enjoy enter escape explain explore fasten fetch fill float
    fold follow gather glow grab grin guard guess hang harvest help hop hover hug hunt imagine
    inform invent jog juggle jump kneel knit knock land laugh launch learn lift listen march melt
    mend mix move nod notice obey offer open order paint park pause pedal perform pinch plant
    play polish pour practice pray print pull punch push race rain reach read relax remember
    repair repeat rescue return ride roll rush sail scatter scream search settle shiver shop sign
    sing skip slide smile sneeze sniff snore solve sort sparkle spell spill sprout squeeze stamp
    stare steer stir stretch suggest swim switch talk taste teach tickle travel trim trot tumble
    twist unlock vanish visit wade walk wander wash watch wave weave whisper whistle wink wobble
    wonder wrap write yawn yell zoom
    """.split()
)


def random_key_words(rng: random.Random, count: int, exclude: set[str] | None = None) -> list[str]:
    """``count`` distinct "adjective-noun" keys (none of them in ``exclude``), drawn with ``rng``.

    Raises:
        ValueError: if more keys are asked for than the lists can combine.
    """
    exclude = exclude or set()
    capacity = len(ADJECTIVES) * len(NOUNS) - len(exclude)
    if count > capacity:
        raise ValueError(f"random_key_words: asked for {count} distinct keys, only {capacity} available")
    keys: list[str] = []
    seen = set(exclude)
    while len(keys) < count:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in seen:
            seen.add(key)
            keys.append(key)
    return keys


def vocabulary(size: int, rng: random.Random) -> list[str]:
    """``size`` distinct words: shuffled single words first, then "adjective-noun" pairs if needed."""
    singles = sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS))
    rng.shuffle(singles)
    if size <= len(singles):
        return singles[:size]
    return singles + random_key_words(rng, size - len(singles), exclude=set(singles))
