"""Deterministic, offline, diverse user turns for building a chat drafter by self-distillation.

The chat model (SmolLM2-135M-Instruct) answers each prompt greedily and the answers become the
drafter's training data, so the prompts should cover the same *kinds* of requests as the held-out
evaluation sets (MT-Bench and Vicuna-bench: writing, roleplay, reasoning, math, coding,
extraction, STEM, humanities, generic advice, knowledge, common sense, Fermi estimates,
counterfactuals), phrased in many different ways. None of their questions is copied here; the
caller also drops any prompt that equals one of their turns.

Everything is synthetic: hand-written word lists and templates filled in with ``random.Random``
seeded from ``seed`` and the source name. Nothing is downloaded, no model is used, and the same
``(n, seed)`` always gives the same list.

Sources (``SOURCES``):

* ``topic``      writing and advice requests (explain, pros and cons, tips, plans, stories, poems,
                 haiku, emails, tweets, speeches, FAQs, lesson plans, debates, ...) about ~300
                 everyday, scientific, historical and cultural topics, comparisons of topic pairs,
                 "what would happen if" counterfactuals and Fermi estimates; some templates add
                 a constraint (length, audience, tone, format).
* ``roleplay``   "pretend / imagine / act as {persona}" with ~60 personas x ~40 situations.
* ``math``       arithmetic and word problems with seeded random numbers (percentages, units,
                 rates, ages, shopping, geometry, equations, averages, ratios, probability,
                 sequences, interest, ...).
* ``reasoning``  logic puzzles and common-sense questions with random names and objects
                 (orderings, true/false/uncertain chains, family relations, weekday arithmetic,
                 syllogisms, counting, odd-one-out, assignment puzzles, directions, clocks, ...).
* ``coding``     programming tasks x languages, SQL and shell tasks, regular expressions,
                 concept questions, and small snippets to explain, test, refactor or fix.
* ``extraction`` synthetic passages (reviews, meeting notes, news about fictional companies,
                 orders, forecasts, bios, recipes, schedules, ...) with a task: summarize,
                 extract, classify, rewrite, title, keywords, answer a question, JSON, ...
* ``knowledge``  STEM and humanities questions over ~250 concepts with several patterns each.

``diverse_prompts(n, seed)`` interleaves the sources round-robin (and, inside a source, its
sub-kinds round-robin), so any prefix of the list is a balanced mix.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def _items(text: str) -> list[str]:
    """Items of a block separated by ``|`` or newlines, stripped, blanks dropped."""
    return [s.strip() for s in text.replace("\n", "|").split("|") if s.strip()]


def _bar_items(text: str) -> list[str]:
    """Items of a block separated by ``|`` only; line breaks inside an item become spaces."""
    return [" ".join(s.split()) for s in text.split("|") if s.strip()]


def _cap(s: str) -> str:
    return s[:1].upper() + s[1:]


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


_NAMES = _items(
    """Alice | Ben | Carmen | Dmitri | Emeka | Fatima | George | Hana | Ivan | Jamal | Keiko |
    Liam | Maya | Nikhil | Olivia | Pedro | Quinn | Rosa | Samir | Tara | Umar | Valeria |
    Wei | Ximena | Yusuf | Zoe | Amara | Bruno | Chloe | Diego | Elena | Farid | Grace |
    Hugo | Ingrid | Jonas | Kofi | Lena | Mateo | Nora | Oscar | Priya | Rafael | Sofia |
    Tomas | Uma | Viktor | Wanda | Yara | Zane"""
)
_MEN = _items(
    "Ben | Dmitri | Emeka | George | Ivan | Jamal | Liam | Nikhil | Pedro | Samir | Umar | Wei |"
    "Yusuf | Bruno | Diego | Farid | Hugo | Jonas | Kofi | Mateo | Oscar | Rafael | Tomas"
)
_WOMEN = _items(
    "Alice | Carmen | Fatima | Hana | Keiko | Maya | Olivia | Rosa | Tara | Valeria | Zoe |"
    "Amara | Chloe | Elena | Grace | Ingrid | Lena | Nora | Priya | Sofia | Uma | Wanda | Yara"
)
_DAYS = _items("Monday | Tuesday | Wednesday | Thursday | Friday | Saturday | Sunday")
_MONTHS = _items(
    "January | February | March | April | May | June | July | August | September | October |"
    "November | December"
)

# ------------------------------------------------------------------------------------------
# topic: writing, advice, comparisons, counterfactuals, Fermi estimates

_ACTIVITIES = _items(
    """time management | budgeting | meal prepping | running | cycling to work |
    learning a second language | learning to play the guitar | gardening | composting |
    urban beekeeping | photography | birdwatching | rock climbing | yoga | meditation |
    journaling | public speaking | job interviewing | networking | remote work | freelancing |
    starting a small business | saving for retirement | investing in index funds |
    baking bread | cooking for one | hiking | camping | fishing | swimming | playing chess |
    knitting | woodworking | pottery | watercolor painting | calligraphy | writing a novel |
    blogging | podcasting | video editing | learning to code | studying for exams |
    note-taking | minimalism | decluttering | recycling at home | volunteering |
    fostering pets | training a puppy | caring for houseplants | raising backyard chickens |
    moving to a new city | traveling on a budget | solo travel | packing light | road trips |
    getting better sleep | drinking more water | strength training | stretching |
    marathon training | cutting back on sugar | managing stress | making friends as an adult |
    parenting teenagers | negotiating a salary | giving feedback | leading a small team |
    running effective meetings | onboarding new employees | customer service |
    writing a resume | planning a wedding | hosting a dinner party |
    throwing a birthday party for kids | learning to drive | basic car maintenance |
    simple home repairs | painting a room | saving energy at home | growing tomatoes |
    stargazing | geocaching | designing board games | learning magic tricks |
    performing stand-up comedy | singing in a choir | learning to dance salsa | skateboarding |
    surfing | skiing | playing tennis | coaching youth soccer | solving crossword puzzles |
    reading more books | taking a digital detox | keeping passwords safe |
    backing up your files | homeschooling | tutoring | mentoring | learning sign language |
    learning first aid | emergency preparedness | sewing | upcycling old clothes |
    thrift shopping | collecting stamps | scuba diving | kayaking | horseback riding | archery |
    fermenting vegetables | making pasta from scratch | grilling | learning to swim as an adult |
    keeping a gratitude journal | working night shifts | commuting by train |
    writing thank-you notes | caring for an elderly parent"""
)
_THINGS = _items(
    """volcanoes | coral reefs | the printing press | the bicycle | electric cars |
    solar panels | wind turbines | smartphones | social media | artificial intelligence |
    video games | the internet | email | cryptocurrencies | public libraries | museums | zoos |
    national parks | the Olympic Games | jazz | hip-hop | classical music | opera |
    street art | cinema | silent films | comic books | poetry | fairy tales | Greek mythology |
    the Roman Empire | ancient Egypt | the Silk Road | the Vikings | the space race | Mars |
    the Moon | the Sun | comets | the deep ocean | deserts | rainforests | glaciers | rivers |
    mountains | islands | honeybees | octopuses | wolves | elephants | whales | ants |
    dinosaurs | sharks | owls | butterflies | mushrooms | old trees | cacti | bamboo | coffee |
    tea | chocolate | bread | cheese | spices | rice | pizza | sushi | vegetarian diets |
    breakfast | dreams | memory | laughter | friendship | kindness | curiosity | patience |
    habits | boredom | nostalgia | color | music festivals | farmers' markets | small towns |
    big cities | skyscrapers | bridges | trains | airplanes | sailing ships | lighthouses |
    castles | robots | 3D printing | drones | satellites | GPS navigation | clocks | calendars |
    money | banks | credit cards | taxes | insurance | plastic pollution | climate change |
    renewable energy | nuclear power | water scarcity | public transportation | traffic jams |
    maps | tourism | hotels | airports | food trucks | supermarkets | online shopping |
    advertising | startups | labor unions | the four-day work week | open-plan offices |
    school uniforms | homework | standardized tests | universities | online courses |
    textbooks | board games | jigsaw puzzles | toys | kites | umbrellas | sneakers | fashion |
    tattoos | perfume | mirrors | gardens | city parks | playgrounds | cats | dogs | horses |
    goldfish | hospitals | nurses | dentists | sugar | salt | clean water | air pollution |
    noise | silence | handwriting | typewriters | radio | television | podcasts | newspapers |
    postcards | birthdays | holidays | New Year's resolutions | weddings | fireworks | rain |
    snow | thunderstorms | rainbows | autumn | winter | spring | summer | sunsets |
    the night sky | time zones | languages | emojis | jokes | superheroes |
    detective stories | science fiction | the human heart | the human brain | bones | teeth |
    the sense of smell | eyesight | vaccines | microplastics | recycling plants | compost bins |
    electric scooters | space tourism | self-driving cars | smart homes |
    wearable fitness trackers |
    virtual reality | password managers | open-source software | encyclopedias | chess |
    the piano | the violin | drums | choirs | ballet | puppet theater | circuses |
    street food | spicy food | fermented foods | honey | olive oil | potatoes | apples |
    lemons | coconuts | ice cream | sandwiches | soup | coffee shops | bakeries |
    seed libraries"""
)

# Templates for any topic. {t}: the topic; {T}: the topic capitalized.
_ANY_INFO = _items(
    """Explain {t} in simple terms.
    Give me five fun facts about {t}.
    Explain {t} like I'm five years old.
    What are the most common misconceptions about {t}?
    How has {t} changed over the last fifty years?
    What might {t} look like in the year 2100?
    Create a FAQ with five questions and answers about {t}.
    Come up with an analogy that helps explain {t}.
    Write ten interview questions for an expert on {t}.
    Create a quiz with five multiple-choice questions about {t}, and give the answers.
    List five questions a curious child might ask about {t}, and answer each one.
    Why do some people love {t} while others find it boring?
    How would you explain the value of {t} to a skeptical friend?
    Give a one-paragraph summary of {t}, then a one-sentence summary.
    Suggest a title and a short outline for a YouTube video about {t}.
    What are the environmental impacts of {t}?
    What would happen if {t} disappeared from the world tomorrow?
    Describe {t} to someone who has never heard of it.
    What jobs or careers are connected to {t}?
    Tell me something surprising about {t} that most people don't know.
    What are three good questions to start a conversation about {t}?
    Suggest five ways to learn more about {t} without spending money."""
)
_ANY_WRITE = _items(  # these may get a constraint appended
    """Write a short story about {t}.
    Write a poem about {t}.
    Write a short blog post about {t}.
    Write a dialogue between two friends who disagree about {t}.
    Write a short speech about {t} for a school assembly.
    Create a lesson plan for a one-hour class on {t}.
    Write a persuasive paragraph arguing that everyone should learn about {t}.
    Summarize the history of {t}.
    Write a newspaper headline and a short article about a surprising discovery involving {t}.
    Write an email inviting your colleagues to a lunchtime talk about {t}.
    Describe {t} using all five senses.
    Write a diary entry from someone who is experiencing {t} for the first time.
    Write a short mystery story in which {t} turns out to be the key clue.
    Describe {t} from the point of view of an alien visiting Earth.
    Write a radio advertisement for a museum exhibition about {t}.
    Write a formal letter to the city council proposing a community event about {t}.
    Write a product description for a board game about {t}.
    Write the opening paragraph of a novel in which {t} plays an important role.
    Write a short motivational message inspired by {t}.
    Write an encyclopedia-style entry about {t}."""
)
_ANY_SHORT = _items(
    """Write a haiku about {t}.
    Write a limerick about {t}.
    Write a tweet about {t}.
    Write a riddle whose answer is {t}.
    Write a two-sentence horror story involving {t}.
    Write a catchy song chorus about {t}.
    Write an acrostic poem about {t}.
    Write a social media caption for a photo related to {t}.
    Write three different slogans for a campaign about {t}.
    Write a knock-knock joke about {t}.
    Write a short children's rhyme about {t}.
    Give me a one-line fortune-cookie message about {t}."""
)
_ACTIVITY_ADVICE = _items(
    """What are the pros and cons of {t}?
    Give me seven practical tips for {t}.
    Create a step-by-step plan for a beginner who wants to get started with {t}.
    What are the most common mistakes people make with {t}, and how can they avoid them?
    Write a beginner's guide to {t}, formatted like a recipe with ingredients and steps.
    How can I get better at {t}?
    How do I stay motivated with {t} when progress feels slow?
    Design a 30-day challenge for {t}.
    What do I need to get started with {t}, and roughly how much will it cost?
    Argue both for and against this claim: "{T} should be taught in every school."
    How much time per week should a beginner spend on {t}?
    Write a short pep talk for someone who has just started {t}.
    How can I fit {t} into a busy schedule?
    Describe a typical weekend for someone who is passionate about {t}.
    What skills does {t} build, and how do they help in other areas of life?
    Write an email to a friend convincing them to try {t} with you.
    I tried {t} once and gave up. How should I approach it differently this time?
    What are the first three things to learn about {t}?
    Is {t} worth it? Give a balanced answer.
    Make a checklist for {t}.
    What questions should I ask an expert before I start {t}?
    How do I know if I'm making progress with {t}?"""
)
_THING_ONLY = _items(
    """What are the advantages and disadvantages of {t}?
    Why do people find {t} so fascinating?
    Prepare opening arguments for both sides of a debate on whether {t} does more good than harm.
    Who benefits most from {t}, and who might be left out?
    How do different cultures think about {t}?
    Write a short scene for a play in which two characters argue about {t}."""
)
_CONSTRAINTS = _items(
    """Keep it under 100 words.
    Write it for a 10-year-old.
    Use a formal tone.
    Use bullet points.
    Use a friendly, casual tone.
    Keep it to three sentences.
    End with a question for the reader.
    Avoid technical jargon.
    Include one concrete example.
    Make it humorous.
    Keep it under 200 words.
    Write it in the second person.
    Use simple words only.
    Give it a hopeful ending.
    Include a title."""
)
_PAIRS = [
    tuple(p.split(" / "))
    for p in _items(
        """tea / coffee | renting an apartment / buying a house | trains / airplanes |
        cats / dogs | paper books / e-readers | running / swimming | city life / country life |
        working from home / working in an office | public schools / private schools |
        solar power / wind power | cooking at home / eating out | credit cards / debit cards |
        learning alone / learning in a group | summer / winter | mountains / beaches |
        jazz / classical music | novels / short stories | yoga / pilates |
        saving money / investing money | introverts / extroverts | email / phone calls |
        handwriting notes / typing notes | electric cars / hybrid cars | museums / zoos |
        podcasts / audiobooks | chess / checkers | baking / cooking | poetry / prose |
        the violin / the cello | freelancing / full-time employment | hiking / cycling |
        board games / video games | newspapers / social media |
        a gap year / going straight to college |
        traveling by car / traveling by bus | watercolor / oil paint | comedy films / drama films |
        owls / hawks | rivers / lakes | frogs / toads | weather / climate | viruses / bacteria |
        speed / velocity | mass / weight | a democracy / a monarchy | a loan / a lease |
        a startup / a large company | sunrise / sunset | mentoring / coaching |
        a resume / a cover letter | camping in a tent / staying in a cabin |
        fruit juice / whole fruit |
        museums / libraries | knitting / crocheting | soccer / basketball |
        the piano / the guitar"""
    )
]
_PAIR_TEMPLATES = _items(
    """Compare {a} and {b}.
    What are the main differences between {a} and {b}?
    {A} or {b}: which would you recommend for a beginner, and why?
    Write a short debate between a fan of {a} and a fan of {b}.
    Make a table comparing {a} and {b} on cost, convenience and enjoyment.
    In what ways are {a} and {b} surprisingly similar?
    Help me choose between {a} and {b}. Ask me two questions first, then give advice.
    Write a funny poem in which {a} and {b} argue about which is better."""
)
_WHAT_IFS = _items(
    """humans could photosynthesize like plants | the Moon were twice as close to Earth |
    everyone could read each other's thoughts | it never rained again in your city |
    all cars suddenly disappeared | people only needed two hours of sleep a night |
    the oceans were made of fresh water | nobody had invented the wheel |
    every person had to change jobs every five years | money had never been invented |
    animals could talk to humans | the internet shut down for a whole month |
    Earth had two suns | all schools switched to a four-day week |
    everyone spoke the same language | humans lived to be 200 years old |
    electricity had never been discovered | gravity were half as strong |
    plants grew ten times faster | there were no more bees |
    the day were 30 hours long | snow were warm instead of cold |
    every book ever written were free | cities banned all advertising |
    people could hibernate through winter | dinosaurs had never gone extinct |
    the printing press had been invented a thousand years earlier |
    telephones had never been invented | everyone had a personal robot assistant |
    the Sahara became a rainforest again | humans had gills |
    clocks had never been invented | all music disappeared from the world |
    pets could vote | the ice at both poles melted within a decade |
    teleportation became cheap and safe | humans could see ultraviolet light |
    nobody could lie | coffee had never been discovered | paper had never been invented |
    the Roman Empire had never fallen | humans had never domesticated dogs |
    sugar were more expensive than gold | every city had a free public library and free transit |
    the Earth stopped spinning for one minute | birds lost the ability to fly |
    people could only speak 100 words per day | cars were banned from city centers worldwide |
    there were no mountains on Earth | spoken language had never developed |
    everyone had to grow their own food | shops were not allowed to use plastic at all"""
)
_WHAT_IF_TEMPLATES = _items(
    """What would happen if {s}?
    Imagine a world where {s}. How would everyday life be different?
    Write a short story set in a world where {s}.
    What are three likely consequences if {s}?
    Describe a typical morning in a world where {s}.
    Suppose {s}. Which industries would change the most, and why?"""
)
_FERMI = _items(
    """How many piano tuners work in a large city | How many golf balls fit inside a school bus |
    How many slices of pizza are eaten in a country in one day |
    How many steps does a person take in a year | How many hairs are on a human head |
    How many trees would it take to make all the paper a school uses in a year |
    How many liters of water does a family use in a week |
    How many cups of coffee are sold in a big city every morning |
    How many bicycles are there in a country of 10 million people |
    How many grains of rice are in a one-kilogram bag | How many leaves are on a large oak tree |
    How many teachers are needed in a city of one million people |
    How many letters are in a 300-page novel | How many heartbeats happen in a human lifetime |
    How many cars pass through a busy intersection in a day |
    How many pencils could you make from one tree | How many dogs live in a large city |
    How many bricks are needed to build a small house |
    How many people are flying in airplanes at any given moment |
    How many tennis balls would fill a swimming pool |
    How many breaths does a person take in a day | How many books are in a typical public library |
    How many sandwiches are eaten at lunchtime in an office tower |
    How many hours of video are watched worldwide in one minute |
    How many light bulbs are there in a city of 500,000 people |
    How many footsteps would it take to walk around the Earth |
    How many ice cubes would fill a bathtub |
    How many raindrops fall on a football field in an hour of rain |
    How many apples does a large orchard produce in one season |
    How many emails does an office worker read in a year |
    How many kilometers does a delivery driver travel in a career |
    How many blades of grass are on a soccer field |
    How many photos are taken worldwide in a day | How many bees live in a large city |
    How many buses does a city of two million people need |
    How many words does a person read in a year |
    How many candles would it take to light a room as brightly as a light bulb |
    How much does all the water in an Olympic swimming pool weigh |
    How long would it take to count to one million out loud |
    How many people could stand in a football stadium's playing field |
    How many seeds are in a watermelon patch | How many meals does a restaurant serve in a year |
    How many shoes are sold in a country in one year |
    How much paper does an office of 100 people print in a month"""
)
_FERMI_TEMPLATES = _items(
    """{q}? Explain your reasoning step by step.
    {q}? Walk me through your estimate.
    Give a rough estimate: {ql}? Show the assumptions you make.
    Make a Fermi estimate. {q}? State each assumption clearly.
    {q}? I don't need an exact number, just a well-reasoned estimate.
    Estimate the answer to this question and explain how you got it: {ql}?"""
)


def _topic(rng: random.Random) -> list[list[str]]:
    def constrain(text: str) -> str:
        if rng.random() < 0.35:
            return f"{text} {rng.choice(_CONSTRAINTS)}"
        return text

    topics = _ACTIVITIES + _THINGS
    info = [tpl.format(t=t, T=_cap(t)) for t in topics for tpl in _ANY_INFO]
    info += [tpl.format(t=t, T=_cap(t)) for t in _THINGS for tpl in _THING_ONLY]
    write = [constrain(tpl.format(t=t, T=_cap(t))) for t in topics for tpl in _ANY_WRITE]
    short = [tpl.format(t=t) for t in topics for tpl in _ANY_SHORT]
    advice = [
        constrain(tpl.format(t=t, T=_cap(t))) for t in _ACTIVITIES for tpl in _ACTIVITY_ADVICE
    ]
    pairs = []
    for a, b in _PAIRS:
        for tpl in rng.sample(_PAIR_TEMPLATES, 4):
            x, y = (a, b) if rng.random() < 0.5 else (b, a)
            pairs.append(tpl.format(a=x, b=y, A=_cap(x)))
    what_ifs = [tpl.format(s=s) for s in _WHAT_IFS for tpl in rng.sample(_WHAT_IF_TEMPLATES, 2)]
    fermi = [
        tpl.format(q=q, ql=q[0].lower() + q[1:])
        for q in _FERMI
        for tpl in rng.sample(_FERMI_TEMPLATES, 2)
    ]
    return [info, write, short, advice, pairs, what_ifs, fermi]


# ------------------------------------------------------------------------------------------
# roleplay

_PERSONAS = _items(
    """a pirate captain | a medieval blacksmith | a tour guide in Rome |
    a customer support agent for an internet provider | a hard-boiled detective |
    a chef at a busy restaurant | a family doctor | a high school sports coach |
    a job interviewer at a software company | a lighthouse keeper |
    an astronaut on a space station | a school librarian | a taxi driver in a big city |
    a kindergarten teacher | a museum curator | a park ranger | a wizard in a fantasy kingdom |
    a Victorian-era butler | a retired sea captain | a barista | a personal trainer |
    a fashion designer | a dairy farmer | a beekeeper | a veterinarian | a firefighter |
    a flight attendant | an airline pilot | a mountain guide | a robot assistant from the future |
    a time traveler from the 1800s | a dragon guarding its treasure | a talking cat |
    a friendly ghost in an old castle | a news anchor | a late-night radio DJ |
    a stand-up comedian | a poet | a philosopher in ancient Athens | a marine biologist |
    an archaeologist at a dig site | a real estate agent | a wedding planner | a bank teller |
    a plumber | a car mechanic | a nurse on a night shift | a career counselor |
    a travel agent | a hotel concierge | a game show host | a submarine captain | a zookeeper |
    a village baker | a tailor | a Shakespearean actor | the mayor of a small town |
    a secret agent | a gardener at a royal palace |
    a scientist at a research station in Antarctica |
    a patient math tutor | a Spanish teacher | a character in a fantasy video game |
    a grumpy old innkeeper | a street musician"""
)
_SITUATIONS = _items(
    """Introduce yourself and describe a typical day.
    What is the hardest part of what you do?
    Give advice to a young person who wants to follow in your footsteps.
    Tell me about the most memorable day of your life.
    A stranger asks you for directions to the nearest market. How do you respond?
    Describe the place where you work in vivid detail.
    What do you wish more people understood about your work?
    I just made a serious mistake at work. What would you tell me?
    Explain how to make a good cup of tea, in your own style.
    What is your opinion of smartphones?
    Write a short letter to your family about your week.
    Someone is rude to you. How do you handle it?
    What are three rules you live by?
    Describe your biggest rival.
    What does success mean to you?
    Convince me to spend a day with you.
    Tell me a short story from your past that taught you an important lesson.
    I'm nervous about a big exam tomorrow. Can you help me calm down?
    How do you celebrate after a good day?
    Explain what you do to a five-year-old.
    Give a short toast at a friend's wedding.
    What would you change about the world if you could?
    Recommend a book, a song, or a meal, and explain why.
    Describe the tools you could not live without.
    I want to quit my job and try something completely new. What do you think?
    React to the news that it will rain for the next seven days.
    Teach me one skill you are good at.
    What is something that always makes you laugh?
    Describe what you see around you right now.
    Write a short advertisement for your services.
    How do you handle a very busy day?
    I plan to run a marathon next month without any training. What's your reaction?
    Tell me about the first time you met your best friend.
    Plan a weekend trip for me.
    Reply to a complaint from an unhappy customer.
    What do you usually eat for breakfast, and why?
    Describe a mistake you made and what you learned from it.
    Give a pep talk to a team before a big challenge.
    What would you say to someone living 100 years in the future?
    Our conversation is ending. Say goodbye in character."""
)
_ROLE_TEMPLATES = _items(
    """Pretend you are {p}. {s}
    Imagine you are {p}. {s}
    Act as {p}. {s}
    You are {p}. Stay in character. {s}
    Role-play as {p} and respond to this: {s}
    For this conversation, be {p}. {s}
    Take on the persona of {p}. {s}
    I want you to act as {p}. {s}
    Answer as if you were {p}. {s}
    Speak like {p} would. {s}"""
)


def _roleplay(rng: random.Random) -> list[list[str]]:
    out = []
    for p in _PERSONAS:
        for s in _SITUATIONS:
            out.append(rng.choice(_ROLE_TEMPLATES).format(p=p, s=s))
    return [out]


# ------------------------------------------------------------------------------------------
# math

_WORK = ["", "", "", " Show your work.", " Explain each step.", " Think step by step."]
_WORK += [" Give the final answer on its own line at the end.", " Please explain your reasoning."]


def _suffixed(rng: random.Random, q: str, suffixes: list[str]) -> str:
    """``q`` plus a random suffix, unless it already asks for an explanation."""
    if "xplain" in q or "step by step" in q:
        return q
    return q + rng.choice(suffixes)


def _money(x: float) -> str:
    return f"${x:,.2f}"


def _lin(a: int, b: int, var: str = "x") -> str:
    """``a*var + b`` written the usual way."""
    head = var if a == 1 else f"-{var}" if a == -1 else f"{a}{var}"
    if b == 0:
        return head
    return f"{head} + {b}" if b > 0 else f"{head} - {-b}"


def _m_percent(r: random.Random) -> str:
    p = r.choice([5, 10, 12, 15, 20, 25, 30, 35, 40, 45, 60, 75, 80, 125, 150])
    n = r.randrange(20, 2000, 20)
    name = r.choice(_NAMES)
    return r.choice(
        [
            f"What is {p}% of {n}?",
            f"Calculate {p} percent of {n}.",
            f"A survey asked {n} people a question and {p}% answered yes. How many said yes?",
            f"{name} has read {p}% of a {n}-page book. How many pages are left?",
            f"What percentage of {n} is {n * p // 100}?",
        ]
    )


def _m_percent_change(r: random.Random) -> str:
    old = r.randrange(20, 500)
    new = old + r.choice([-1, 1]) * r.randrange(1, old // 2 + 2)
    item = r.choice(["a monthly bus pass", "a concert ticket", "a bag of coffee", "a haircut"])
    return r.choice(
        [
            f"The price of {item} changed from ${old} to ${new}. What is the percent change?",
            f"A town's population went from {old * 100:,} to {new * 100:,}. "
            "By what percentage did it change?",
            f"A plant was {old} mm tall and is now {new} mm. What is the percentage change?",
        ]
    )


def _m_discount(r: random.Random) -> str:
    price = r.randrange(15, 400) + r.choice([0, 0.5, 0.99])
    d = r.choice([10, 15, 20, 25, 30, 40, 50])
    tax = r.choice([5, 6, 8, 10])
    item = r.choice(["jacket", "pair of boots", "lamp", "backpack", "blender", "bicycle helmet"])
    return r.choice(
        [
            f"A {item} costs {_money(price)} and is on sale for {d}% off. What is the sale price?",
            f"A {item} is marked {_money(price)}. It is discounted by {d}%, then a {tax}% "
            "sales tax is added. What is the final price?",
            f"After a {d}% discount, a {item} costs {_money(price)}. What was the original price?",
            f"Which is the better deal on a {_money(price)} {item}: {d}% off, or ${d // 2} off?",
        ]
    )


_CONVERSIONS = [
    ("kilometers", "miles"),
    ("miles", "kilometers"),
    ("kilograms", "pounds"),
    ("pounds", "kilograms"),
    ("liters", "milliliters"),
    ("inches", "centimeters"),
    ("feet", "meters"),
    ("minutes", "hours and minutes"),
    ("seconds", "minutes and seconds"),
    ("square meters", "square centimeters"),
    ("cups", "milliliters"),
    ("degrees Celsius", "degrees Fahrenheit"),
    ("degrees Fahrenheit", "degrees Celsius"),
    ("kilometers per hour", "meters per second"),
    ("gigabytes", "megabytes"),
    ("days", "hours"),
]


def _m_convert(r: random.Random) -> str:
    src, dst = r.choice(_CONVERSIONS)
    x = r.choice([r.randrange(2, 400), round(r.uniform(1, 100), 1)])
    return r.choice(
        [
            f"Convert {x} {src} to {dst}.",
            f"How many {dst} are in {x} {src}?",
            f"Express {x} {src} in {dst}.",
            f"A recipe or sign says {x} {src}. What is that in {dst}?",
        ]
    )


def _m_speed(r: random.Random) -> str:
    v = r.randrange(4, 120)
    t = r.choice([0.5, 1.5, 2, 2.5, 3, 4, 45 / 60])
    d = r.randrange(20, 600)
    a, b = r.randrange(30, 90), r.randrange(30, 110)
    who = r.choice(["A cyclist", "A train", "A runner", "A car", "A boat", "A hiker"])
    return r.choice(
        [
            f"{who} travels at {v} km/h for {t} hours. How far does it go?",
            f"{who} covers {d} km in {r.randrange(1, 9)} hours and {r.choice([10, 15, 30, 45])} "
            "minutes. What is its average speed?",
            f"Two cars start {d} km apart and drive toward each other at {a} km/h and {b} km/h. "
            "How long until they meet?",
            f"{r.choice(_NAMES)} drives {d} km at {a} km/h and returns at {b} km/h. "
            "What is the average speed for the whole trip?",
            f"How long does it take to walk {round(d / 50, 1)} km at {r.choice([4, 5, 6])} km/h?",
        ]
    )


def _m_ages(r: random.Random) -> str:
    a, b = r.sample(_NAMES, 2)
    young = r.randrange(3, 40)
    k = r.randrange(2, 30)
    y = r.randrange(2, 15)
    m = r.choice([2, 3, 4])
    return r.choice(
        [
            f"{a} is {k} years older than {b}. In {y} years, the sum of their ages will be "
            f"{2 * young + k + 2 * y}. How old is each of them now?",
            f"{a} is {m} times as old as {b}. The difference in their ages is "
            f"{(m - 1) * young}. How old are they?",
            f"{y} years ago, {a} was {young + k} years old. How old will {a} be in {k} years?",
            f"{a} is three times as old as {b}. In {y} years, {a} will be twice as old as {b}. "
            "How old are they now?",
            f"The sum of the ages of {a} and {b} is {2 * young + k}, and {a} is {k} years older. "
            f"How old is {b}?",
        ]
    )


_SHOP = [
    ("notebook", 1.5, 6),
    ("pen", 0.6, 3),
    ("apple", 0.3, 1.2),
    ("loaf of bread", 2, 6),
    ("coffee", 2.5, 5.5),
    ("movie ticket", 7, 16),
    ("sandwich", 4, 9),
    ("T-shirt", 8, 30),
    ("paperback book", 6, 18),
    ("bottle of juice", 1.5, 4),
    ("pack of batteries", 3, 12),
    ("plant pot", 2, 15),
]


def _m_shopping(r: random.Random) -> str:
    picks = r.sample(_SHOP, r.choice([2, 3]))
    parts, total = [], 0.0
    for item, lo, hi in picks:
        q, price = r.randrange(1, 6), round(r.uniform(lo, hi), 2)
        total += q * price
        parts.append(f"{q} x {item} at {_money(price)} each")
    bill = next(b for b in (10, 20, 50, 100, 200, 500) if b > total)
    name = r.choice(_NAMES)
    items = "; ".join(parts)
    return r.choice(
        [
            f"{name} buys {items}. They pay with a ${bill} bill. How much change do they get?",
            f"What is the total cost of: {items}?",
            f"Shopping list: {items}. If there is a 10% member discount on the total, "
            "how much is paid?",
            f"{name} has ${bill} and wants to buy {items}. Is that enough money? "
            "How much is left over or missing?",
        ]
    )


def _m_geometry(r: random.Random) -> str:
    a, b, c = r.randrange(2, 40), r.randrange(2, 40), r.randrange(2, 25)
    rad = r.randrange(1, 30)
    return r.choice(
        [
            f"What are the area and perimeter of a rectangle that is {a} m by {b} m?",
            f"A circle has a radius of {rad} cm. Find its area and circumference.",
            f"A triangle has a base of {a} cm and a height of {b} cm. What is its area?",
            f"What is the volume of a box that measures {a} cm by {b} cm by {c} cm?",
            f"A cylinder has radius {rad} cm and height {c} cm. What is its volume?",
            f"A room is {a % 12 + 3} m by {b % 9 + 3} m. How many 0.5 m by 0.5 m tiles are "
            "needed to cover the floor?",
            f"A square garden has an area of {a * a} square meters. How much fencing is needed "
            "to go around it?",
            f"A right triangle has legs of {a} and {b}. How long is the hypotenuse?",
            f"A cube has a surface area of {6 * c * c} square cm. What is its volume?",
            f"A pizza with a {2 * rad} cm diameter is cut into 8 equal slices. "
            "What is the area of one slice?",
        ]
    )


def _m_linear(r: random.Random) -> str:
    x = r.randrange(-12, 20)
    a = r.choice([2, 3, 4, 5, 6, 7, 8, 9, -2, -3])
    b = r.randrange(-30, 40)
    c = a * x + b
    k = r.randrange(2, 6)
    return r.choice(
        [
            f"Solve for x: {_lin(a, b)} = {c}.",
            f"Find x if {_lin(a, b)} = {c}.",
            f"What value of y makes {_lin(a, b, 'y')} = {c} true?",
            f"Solve: {k}({_lin(1, b)}) = {k * (x + b)}.",
            f"Solve the equation {_lin(a + k, b)} = {_lin(k, c)}.",
            f"I think of a number, multiply it by {a} and add {b}. The result is {c}. "
            "What was my number?",
        ]
    )


def _m_system(r: random.Random) -> str:
    x, y = r.randrange(-5, 20), r.randrange(-5, 20)
    a, b = r.randrange(2, 7), r.randrange(2, 7)
    p, q = r.randrange(2, 6), r.randrange(2, 6)
    return r.choice(
        [
            f"Solve the system: x + y = {x + y} and x - y = {x - y}.",
            f"Solve for x and y: {a}x + {b}y = {a * x + b * y}, {p}x - {q}y = {p * x - q * y}.",
            f"Two numbers add up to {x + y + 40} and differ by {abs(x - y)}. What are they?",
            f"Tickets cost $5 for children and $9 for adults. {x + y + 20} tickets were sold for "
            f"${5 * (x + 10) + 9 * (y + 10)}. How many of each were sold?",
        ]
    )


def _m_average(r: random.Random) -> str:
    xs = [r.randrange(50, 100) for _ in range(r.randrange(3, 7))]
    target = r.randrange(70, 95)
    s = ", ".join(map(str, xs))
    name = r.choice(_NAMES)
    return r.choice(
        [
            f"What is the mean of these test scores: {s}?",
            f"{name}'s test scores are {s}. What score is needed on the next test for an "
            f"average of {target}?",
            f"Find the mean, median, and range of: {s}.",
            f"The average of {len(xs)} numbers is {target}. If one number, {xs[0]}, is removed, "
            "what is the average of the rest?",
            f"A basketball player scored {s} points in recent games. What is the average per game?",
        ]
    )


def _m_ratio(r: random.Random) -> str:
    a, b = r.randrange(1, 8), r.randrange(1, 8)
    total = (a + b) * r.randrange(5, 60)
    serv, serv2 = r.randrange(2, 7), r.randrange(3, 13)
    q = r.choice([1.5, 2, 2.5, 3, 0.75])
    x, y = r.sample(_NAMES, 2)
    return r.choice(
        [
            f"{x} and {y} split ${total} in the ratio {a}:{b}. How much does each get?",
            f"A recipe for {serv} servings needs {q} cups of flour. How much flour is needed "
            f"for {serv2} servings?",
            f"The ratio of boys to girls in a class is {a}:{b}. There are {total} students. "
            "How many are girls?",
            f"Paint is mixed blue to yellow in the ratio {a}:{b}. How much yellow is needed "
            f"with {a * 3} liters of blue?",
            f"On a map, 1 cm represents {r.choice([2, 5, 10, 25])} km. Two towns are {q * 4} cm "
            "apart on the map. How far apart are they really?",
        ]
    )


def _m_probability(r: random.Random) -> str:
    k = r.randrange(2, 13)
    n = r.randrange(2, 7)
    h = r.randrange(0, n + 1)
    red, blue, green = r.randrange(1, 9), r.randrange(1, 9), r.randrange(0, 6)
    rank = r.choice(["an ace", "a king", "a heart", "a red card", "a face card", "a seven"])
    return r.choice(
        [
            f"Two fair six-sided dice are rolled. What is the probability that the sum is {k}?",
            f"A fair coin is flipped {n} times. What is the probability of exactly {h} heads?",
            f"What is the probability of drawing {rank} from a standard 52-card deck?",
            f"A bag holds {red} red, {blue} blue and {green} green marbles. One is picked at "
            "random. What is the probability it is not blue?",
            f"A bag holds {red} red and {blue} blue marbles. Two are drawn without replacement. "
            "What is the probability both are red?",
            f"What is the probability of rolling a six on a fair die {n} times in a row?",
            f"Two cards are drawn from a shuffled deck without replacement. What is the chance "
            f"that both are {rank.split()[-1]}s?",
            f"A spinner has {n + 2} equal sections numbered 1 to {n + 2}. What is the "
            "probability of landing on an even number twice in a row?",
        ]
    )


def _m_sequence(r: random.Random) -> str:
    a, d = r.randrange(-10, 30), r.randrange(2, 12)
    g, q = r.randrange(1, 6), r.choice([2, 3, 4])
    n = r.randrange(10, 60)
    arith = ", ".join(str(a + i * d) for i in range(4))
    geo = ", ".join(str(g * q**i) for i in range(4))
    return r.choice(
        [
            f"What is the next number in the sequence {arith}, ...?",
            f"Find the {n}th term of the sequence {arith}, ...",
            f"What is the sum of the first {n} terms of {arith}, ...?",
            f"What comes next: {geo}, ...? Explain the pattern.",
            f"What is the sum of all whole numbers from 1 to {n * 10}?",
            f"Find the next two numbers: {', '.join(str(i * i + a) for i in range(1, 5))}, ...",
        ]
    )


def _m_interest(r: random.Random) -> str:
    p = r.randrange(5, 200) * 100
    rate = r.choice([1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8])
    t = r.randrange(2, 21)
    return r.choice(
        [
            f"How much simple interest does ${p:,} earn at {rate}% per year for {t} years?",
            f"${p:,} is invested at {rate}% interest compounded yearly. How much is there after "
            f"{t} years?",
            f"A loan of ${p:,} charges {rate}% simple interest per year. What is owed after "
            f"{t} years?",
            f"Roughly how many years does it take money to double at {rate}% compound interest?",
            f"Which is better after {t} years on ${p:,}: {rate}% simple interest or "
            f"{rate - 0.5}% compounded yearly?",
        ]
    )


def _m_work_rate(r: random.Random) -> str:
    a, b = r.randrange(2, 13), r.randrange(2, 13)
    x, y = r.sample(_NAMES, 2)
    return r.choice(
        [
            f"Pipe A fills a tank in {a} hours and pipe B fills it in {b} hours. How long does "
            "it take with both pipes open?",
            f"{x} can paint a fence in {a} hours and {y} can paint it in {b} hours. How long if "
            "they work together?",
            f"{a + 1} workers build a wall in {b + 2} days. How long would {a + 4} workers take, "
            "working at the same rate?",
            f"A printer prints {a * 10} pages per minute. How long does it take to print "
            f"{a * b * 100} pages?",
        ]
    )


def _m_fractions(r: random.Random) -> str:
    a, b, c, d = r.randrange(1, 9), r.randrange(2, 10), r.randrange(1, 9), r.randrange(2, 10)
    op = r.choice(["+", "-", "x", "divided by"])
    return r.choice(
        [
            f"What is {a}/{b} {op} {c}/{d}? Simplify your answer.",
            f"Which is larger, {a}/{b} or {c}/{d}? Explain.",
            f"Write {a}/{b} as a decimal and as a percentage.",
            f"A pizza is cut into {b * 2} slices. {r.choice(_NAMES)} eats {a} slices and a friend "
            f"eats {c} slices. What fraction of the pizza is left?",
        ]
    )


def _m_time(r: random.Random) -> str:
    h, m = r.randrange(6, 22), r.choice([0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55])
    dh, dm = r.randrange(0, 4), r.randrange(5, 60, 5)
    h2, m2 = r.randrange(h + 1, 24), r.randrange(0, 60, 5)
    return r.choice(
        [
            f"A movie starts at {h}:{m:02d} and lasts {dh} hours {dm} minutes. When does it end?",
            f"How many minutes are there between {h}:{m:02d} and {h2}:{m2:02d}?",
            f"A train leaves at {h}:{m:02d} and arrives at {h2}:{m2:02d}. How long is the trip?",
            f"A recipe needs {dh + 1} hours {dm} minutes. Dinner is at {h2}:{m2:02d}. "
            "When must cooking start?",
            f"If a flight departs at {h}:{m:02d} in a city 3 hours behind another, and the flight "
            f"takes {dh + 2} hours, what is the local arrival time in the other city?",
        ]
    )


def _m_polynomial(r: random.Random) -> str:
    a, b, c = r.randrange(1, 6), r.randrange(-9, 10), r.randrange(-15, 16)
    k = r.randrange(-4, 5)
    r1, r2 = r.randrange(-9, 10), r.randrange(-9, 10)
    s, p = -(r1 + r2), r1 * r2
    quad = "x^2" + (f" + {s}x" if s > 0 else f" - {-s}x" if s < 0 else "")
    quad += f" + {p}" if p > 0 else f" - {-p}" if p < 0 else ""
    poly = (
        f"{a}x^2" + (f" + {b}x" if b >= 0 else f" - {-b}x") + (f" + {c}" if c >= 0 else f" - {-c}")
    )
    return r.choice(
        [
            f"Evaluate g(x) = {poly} at x = {k}.",
            f"Solve the quadratic equation {quad} = 0.",
            f"Factor {quad}.",
            f"For p(x) = {poly}, compute p({k}) and p({k + 1}).",
            f"Find the vertex of the parabola y = {poly}.",
        ]
    )


def _m_coordinates(r: random.Random) -> str:
    x1, y1, x2, y2 = (r.randrange(-10, 11) for _ in range(4))
    return r.choice(
        [
            f"Find the distance between the points ({x1}, {y1}) and ({x2}, {y2}).",
            f"What is the midpoint of the segment joining ({x1}, {y1}) and ({x2}, {y2})?",
            f"What is the slope of the line through ({x1}, {y1}) and ({x2}, {y2 + 11})?",
            f"Write the equation of the line through ({x1}, {y1}) with slope {r.randrange(-5, 6)}.",
        ]
    )


def _m_number(r: random.Random) -> str:
    a, b = r.randrange(12, 300), r.randrange(12, 300)
    n = r.randrange(30, 2000)
    d = r.randrange(3, 13)
    return r.choice(
        [
            f"What is the greatest common divisor of {a} and {b}?",
            f"Find the least common multiple of {a % 30 + 2} and {b % 40 + 2}.",
            f"Write the prime factorization of {n}.",
            f"What is the remainder when {n} is divided by {d}?",
            f"Is {n} a prime number? How can you tell?",
            f"How many whole numbers between 1 and {n} are divisible by {d}?",
            f"What is the sum of the digits of {n * 37}, and is the number divisible by 3?",
        ]
    )


def _m_money_life(r: random.Random) -> str:
    wage, hours = round(r.uniform(12, 45), 2), r.randrange(30, 56)
    dist, use, fuel = (
        r.randrange(50, 900),
        round(r.uniform(4.5, 11), 1),
        round(r.uniform(1.2, 2.2), 2),
    )
    rent, people = r.randrange(900, 3500), r.randrange(2, 6)
    return r.choice(
        [
            f"{r.choice(_NAMES)} earns {_money(wage)} per hour and works {hours} hours this week. "
            "Hours over 40 are paid at 1.5 times the rate. What is the weekly pay?",
            f"A car uses {use} liters of fuel per 100 km. Fuel costs {_money(fuel)} per liter. "
            f"What does a {dist} km trip cost?",
            f"{people} roommates share a rent of ${rent} per month, plus utilities of "
            f"${rent // 10}. How much does each pay per year?",
            f"A phone plan costs ${r.randrange(10, 40)} per month plus $0.10 per text. With "
            f"{r.randrange(50, 400)} texts in a month, what is the bill?",
            f"If you save ${r.randrange(5, 60)} every week, how long until you have "
            f"${r.randrange(5, 50) * 100}?",
        ]
    )


_MATH_KINDS: tuple[Callable[[random.Random], str], ...] = (
    _m_percent,
    _m_percent_change,
    _m_discount,
    _m_convert,
    _m_speed,
    _m_ages,
    _m_shopping,
    _m_geometry,
    _m_linear,
    _m_system,
    _m_average,
    _m_ratio,
    _m_probability,
    _m_sequence,
    _m_interest,
    _m_work_rate,
    _m_fractions,
    _m_time,
    _m_polynomial,
    _m_coordinates,
    _m_number,
    _m_money_life,
)


def _math(rng: random.Random) -> list[list[str]]:
    return [[_suffixed(rng, f(rng), _WORK) for _ in range(120)] for f in _MATH_KINDS]


# ------------------------------------------------------------------------------------------
# reasoning

_ATTRS = [  # comparative, opposite, top, bottom
    ("taller", "shorter", "the tallest", "the shortest"),
    ("older", "younger", "the oldest", "the youngest"),
    ("faster", "slower", "the fastest runner", "the slowest runner"),
    ("heavier", "lighter", "the heaviest", "the lightest"),
]
_PRICED = _items(
    "the lamp | the chair | the table | the rug | the clock | the mirror | the vase | the shelf |"
    "the kettle | the toaster | the bicycle | the scooter | the guitar | the drum | the tent"
)
_CATEGORIES = {
    "fruits": "apple | banana | cherry | mango | pear | plum | grape | kiwi | peach",
    "vehicles": "car | bus | bicycle | truck | train | tram | scooter | van",
    "instruments": "violin | flute | piano | trumpet | cello | drum | harp | clarinet",
    "planets": "Mars | Venus | Jupiter | Saturn | Mercury | Neptune | Uranus",
    "colors": "red | blue | green | yellow | purple | orange | teal | violet",
    "tools": "hammer | wrench | screwdriver | saw | pliers | chisel | drill",
    "countries": "France | Kenya | Japan | Brazil | Canada | Egypt | Peru | Norway",
    "furniture": "sofa | table | chair | wardrobe | bookshelf | bed | stool",
    "birds": "sparrow | eagle | robin | parrot | owl | penguin | swan | crow",
    "mammals": "whale | bat | tiger | horse | rabbit | dolphin | elephant | mouse",
    "metals": "iron | copper | gold | silver | zinc | tin | aluminum",
    "shapes": "circle | square | triangle | hexagon | oval | rectangle | pentagon",
    "sports": "tennis | soccer | golf | rugby | hockey | cricket | volleyball",
    "vegetables": "carrot | onion | potato | spinach | leek | cabbage | pea",
    "kitchen items": "spoon | fork | ladle | whisk | spatula | colander | kettle",
    "weather": "rain | snow | hail | fog | sleet | drizzle | thunder",
    "body parts": "elbow | knee | ankle | wrist | shoulder | hip | thumb",
    "clothing": "shirt | scarf | jacket | sock | glove | hat | coat",
    "gems": "ruby | emerald | sapphire | diamond | opal | topaz | garnet",
    "trees": "oak | maple | birch | pine | willow | cedar | elm",
}
_CATEGORIES_ITEMS = {k: _items(v) for k, v in _CATEGORIES.items()}
_NONSENSE = _items("blickets | wugs | zorbs | flurbs | tovs | snerps | quibs | lorps | feps | mims")
_REAL_GROUPS = _items(
    "cats | mammals | animals | pets | birds | robots | machines | teachers | musicians |"
    "artists | tulips | flowers | plants | squares | rectangles | athletes | students | poets"
)
_PET_SETS = [
    ("pet", _items("cat | dog | parrot | rabbit | hamster | turtle")),
    ("drink", _items("tea | coffee | juice | milk | lemonade | cocoa")),
    ("car color", _items("red | blue | white | black | green | silver")),
    ("instrument", _items("piano | violin | guitar | flute | drums | cello")),
    ("favorite sport", _items("tennis | soccer | swimming | chess | golf | rowing")),
    ("home city", _items("Oslo | Lima | Cairo | Seoul | Dublin | Perth")),
]
_COMMON_SENSE = _bar_items(
    """{A} left an ice cream cone on a park bench on a hot afternoon and came back an hour later.
    What did {A} most likely find, and why? | {A} wants to walk across a frozen lake in early
    spring. What should {A} think about first? | {A} hears thunder {n} seconds after seeing a
    flash of lightning. Roughly how far away was the strike? | {A} puts a metal fork in the
    microwave. What could happen, and why is it a bad idea? | Why might {A} carry an umbrella
    on a sunny morning? | {A}'s houseplant has yellow leaves and the soil is always soggy.
    What is the most likely cause? | {A} arrives at a bakery at 3 pm and finds it closed,
    although the sign says it opens every day. What are some possible explanations? | {A} sees
    wet streets but no rain falling. List some possible explanations. | {A} has a train at
    8:15 and the station is {n} minutes away. Traffic is heavy today. When should {A} leave
    home, and why? | Every morning, {A} finds the car windshield covered in water droplets
    even when it did not rain. Why? | {A} put a sealed glass bottle full of water in the
    freezer overnight. What probably happened? | {A} notices that the bread bought last week
    has green spots. Is it safe to cut off the spots and eat the rest? Explain. | {A} wants to
    cool a room quickly on a summer evening. Should {A} open windows on one side or on
    opposite sides? Why? | {A} is packing for a week-long trip to a city where it is winter.
    What might {A} forget that would be a problem? | Why does {A}'s phone battery drain faster
    on a very cold day? | {A} plants sunflower seeds in a dark basement. What will probably
    happen? | {A}'s dog barks every time the mail carrier comes, and the mail carrier always
    leaves. What might the dog be learning? | {A} borrows a friend's car and returns it with
    an empty tank. Why might the friend be upset? | {A} is told a store is "just five minutes
    away" by someone on a bicycle. {A} is walking. How long might it really take? | {A} hangs
    wet laundry outside on a cold but sunny and windy day. Will it dry? Explain. | {A} stands
    on a bathroom scale in an elevator that starts moving up. What happens to the reading? |
    {A} sees a line of people outside a small restaurant while the big one next door is empty.
    What might {A} conclude, and could that be wrong? | {A} drops a feather and a hammer at
    the same time on the Moon. Which lands first? | {A} wakes up, sees it is dark outside, and
    assumes it is night. What else could explain the darkness? | {A} leaves a bowl of water on
    a windowsill for a week. What happens to the water, and why? | Why would {A} put salt on
    an icy sidewalk? | {A} gets a text from an unknown number saying a package is waiting and
    asking for a card number. What should {A} do? | {A} wants to know whether an egg is raw or
    hard-boiled without cracking it. How can {A} tell? | {A} is lost in a forest in the
    afternoon and the sun is getting lower. How can {A} find west? | {A} sees a friend yawn
    and then yawns too. Why might that happen?"""
)
_WEIGHING = [3, 8, 9, 12, 27, 80, 81]


def _chain(r: random.Random, xs: list[str], more: str, less: str) -> list[str]:
    """Adjacent comparisons of an ordered list (first is the most), shuffled and reworded."""
    facts = []
    for hi, lo in itertools.pairwise(xs):
        facts.append(
            f"{hi} is {more} than {lo}." if r.random() < 0.6 else f"{lo} is {less} than {hi}."
        )
    r.shuffle(facts)
    return facts


def _r_order(r: random.Random) -> str:
    more, less, top, bottom = r.choice(_ATTRS)
    xs = r.sample(_NAMES, r.randrange(3, 6))
    facts = " ".join(_chain(r, xs, more, less))
    a, b = r.sample(xs, 2)
    return r.choice(
        [
            f"{facts} Who is {top}?",
            f"{facts} Who is {bottom}?",
            f"{facts} Rank everyone from {top[4:]} to {bottom[4:]}.",
            f"{facts} Is {a} {more} than {b}? Explain how you know.",
            f"Read the clues and answer. {facts} Who is in the middle?",
        ]
    )


def _r_true_false(r: random.Random) -> str:
    xs = r.sample(_PRICED, 3)
    facts = _chain(r, xs, "more expensive", "cheaper")
    a, b = r.sample(xs, 2)
    if r.random() < 0.3:  # a chain with a gap: the answer may be uncertain
        extra = r.choice([p for p in _PRICED if p not in xs])
        facts.append(f"{_cap(extra)} is cheaper than {xs[0]}.")
        b = extra
    facts = " ".join(_cap(f) for f in facts)
    return r.choice(
        [
            f"{facts} If these statements are true, is it true, false, or uncertain that {a} "
            f"is more expensive than {b}?",
            f"Suppose: {facts} Can we be sure that {b} costs less than {a}? Explain.",
            f"Given the following facts, what can you conclude about {a} and {b}? {facts}",
        ]
    )


def _r_family(r: random.Random) -> str:
    m1, m2 = r.sample(_MEN, 2)
    f1, f2 = r.sample(_WOMEN, 2)
    return r.choice(
        [
            f"{m1} is the father of {f1}. {f1} is the mother of {m2}. How is {m1} related to {m2}?",
            f"{f1}'s brother {m1} has a daughter named {f2}. What is {f2} to {f1}?",
            f"{m1} is {f1}'s only brother. {f1} has two children, {m2} and {f2}. "
            f"What is {m1} to {f2}?",
            f"{f1} is married to {m1}. {m1}'s sister is {f2}. What is {f2} to {f1}?",
            f"{f1} points to a man in a photo and says: \"His mother is my mother's only "
            f'daughter." Who is the man to {f1}?',
            f"{m2}'s grandmother is {f1}. {f1}'s son is {m1}, who has only one child. "
            f"If {m2} is that child, what is {m1} to {m2}?",
            f"{f2} is the daughter of {m1}'s sister. What is {m1} to {f2}, "
            f"and what is {f2} to {m1}?",
            f"{m1} and {f1} are siblings. {m2} is {m1}'s son and {f2} is {f1}'s daughter. "
            f"How are {m2} and {f2} related?",
        ]
    )


def _r_days(r: random.Random) -> str:
    d = r.choice(_DAYS)
    n = r.randrange(2, 400)
    k, j = r.randrange(2, 12), r.randrange(3, 15)
    return r.choice(
        [
            f"If today is {d}, what day of the week will it be in {n} days?",
            f"If {n} days ago was a {d}, what day is it today?",
            f"If the day after tomorrow is {d}, what day was yesterday?",
            f"A club meets every {k} days. The first meeting is on a {d}. On which day of the "
            f"week is meeting number {j}?",
            f"If {r.choice(_MONTHS)} 1 falls on a {d} in a year with 31 days in that month, "
            "what day is the last day of the month?",
            f"Three days before the day after tomorrow is {d}. What day is today?",
        ]
    )


def _r_syllogism(r: random.Random) -> str:
    pool = _NONSENSE if r.random() < 0.5 else _REAL_GROUPS
    a, b, c = r.sample(pool, 3)
    note = r.choice(["", " Assume the statements are true even if they sound odd."])
    return r.choice(
        [
            f"All {a} are {b}. All {b} are {c}. Are all {a} {c}?{note} Explain.",
            f"All {a} are {b}. Some {b} are {c}. Does it follow that some {a} are {c}?{note}",
            f"No {a} are {b}. Some {c} are {a}. What can we conclude about {c} and {b}?{note}",
            f"Some {a} are {b}. All {b} are {c}. Must some {a} be {c}?{note} Explain.",
            f"All {a} are {b}. This thing is not one of the {b}. Is it one of the {a}?{note}",
            f"Is this argument valid? All {a} are {b}; some {c} are {b}; so some {c} are {a}.",
        ]
    )


def _r_counting(r: random.Random) -> str:
    name = r.choice(_MEN)
    s, b = r.randrange(1, 6), r.randrange(0, 4)
    n = r.randrange(4, 30)
    c, g = r.randrange(3, 40), r.randrange(2, 30)
    d = r.randrange(1, 10)
    return r.choice(
        [
            f"{name} has {s} sisters and {b} brothers. How many sons do {name}'s parents have?",
            f"There are {n} people at a party and everyone shakes hands with everyone else once. "
            "How many handshakes happen?",
            f"A farmer has {c} chickens and {g} goats. How many legs are there in total?",
            f"There are {n} birds on a fence. {n // 3} fly away, then {d + 1} more land. "
            "How many birds are on the fence?",
            f"How many times does the digit {d} appear when you write all the numbers from 1 "
            f"to {n * 5}?",
            f"A round-robin tournament has {n % 12 + 3} teams. Each pair plays once. "
            "How many games are played?",
            f"{name} has {s} sisters. Each sister has {b + 1} brothers. How many children are "
            "in the family? Explain.",
            f"A staircase has {n} steps. You can climb 1 or 2 steps at a time. How many ways "
            f"are there to climb the first {min(n, 8)} steps?",
        ]
    )


def _r_odd_one_out(r: random.Random) -> str:
    cat, other = r.sample(sorted(_CATEGORIES_ITEMS), 2)
    odd = r.choice([w for w in _CATEGORIES_ITEMS[other] if w not in _CATEGORIES_ITEMS[cat]])
    words = r.sample(_CATEGORIES_ITEMS[cat], r.choice([3, 4])) + [odd]
    r.shuffle(words)
    w = ", ".join(words)
    return r.choice(
        [
            f"Which is the odd one out: {w}? Explain why.",
            f"One of these does not fit with the rest: {w}. Which one, and why?",
            f"Find the word that doesn't belong in this list and explain: {w}.",
            f"Group these words and say which one is different: {w}.",
        ]
    )


def _r_assignment(r: random.Random) -> str:
    kind, options = r.choice(_PET_SETS)
    people = r.sample(_NAMES, 3)
    things = r.sample(options, 3)
    a, b, _ = people
    _, pb, pc = things
    if kind == "pet":
        clues = [f"{b} has the {pb}.", f"{a} does not have the {pc}."]
    else:
        clues = [f"{b}'s {kind} is {pb}.", f"{a}'s {kind} is not {pc}."]
    r.shuffle(clues)
    order = r.sample(people, 3)
    opts = ", ".join(r.sample(things, 3))
    head = f"{order[0]}, {order[1]} and {order[2]} each have a different {kind}: {opts}."
    return f"{head} {' '.join(clues)} Who has which {kind}? Explain your reasoning."


def _r_directions(r: random.Random) -> str:
    name = r.choice(_NAMES)
    a, b, c = r.randrange(1, 10), r.randrange(1, 10), r.randrange(1, 10)
    start = r.choice(["north", "south", "east", "west"])
    t1, t2 = r.choice(["left", "right"]), r.choice(["left", "right"])
    return r.choice(
        [
            f"{name} walks {a} km {start}, turns {t1} and walks {b} km, then turns {t2} and "
            f"walks {c} km. How far is {name} from the start, and in which direction?",
            f"{name} is facing {start}. After turning {t1}, then {t2}, then turning around, "
            f"which direction is {name} facing?",
            f"In the morning, {name}'s shadow points toward the {start}. Which way is {name} "
            "facing if the sun is directly behind?",
        ]
    )


def _r_misc(r: random.Random) -> str:
    h, m = r.randrange(1, 13), r.randrange(0, 60, 5)
    x, y = r.sample(["notebook", "pen", "ball", "bat", "cup", "saucer", "hat", "scarf"], 2)
    d, t = r.randrange(1, 10), r.randrange(11, 30)
    n = r.choice(_WEIGHING)
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    st = r.randrange(0, 5)
    step = r.randrange(1, 4)
    seq = ", ".join(letters[st + i * step + i * (i - 1) // 2] for i in range(4))
    return r.choice(
        [
            f"What is the angle between the hour and minute hands of a clock at {h}:{m:02d}?",
            f"A {x} and a {y} cost ${t + 0.1 * d:.2f} together. The {x} costs ${t:.2f} more than "
            f"the {y}. How much does the {y} cost?",
            f"You have {n} coins that look the same, but one is heavier. Using a balance scale, "
            "what is the fewest number of weighings that always finds it?",
            f"What letter comes next: {seq}, ...? Explain the pattern.",
            f"A snail climbs {d + 2} meters up a wall each day and slides back {d} meters each "
            f"night. The wall is {t} meters high. On which day does it reach the top?",
            f"If it takes {d + 2} machines {d + 2} minutes to make {d + 2} widgets, how long "
            f"would it take {t * 5} machines to make {t * 5} widgets?",
        ]
    )


def _r_common_sense(r: random.Random) -> str:
    return r.choice(_COMMON_SENSE).format(A=r.choice(_NAMES), n=r.randrange(3, 16))


_REASONING_KINDS: tuple[Callable[[random.Random], str], ...] = (
    _r_order,
    _r_true_false,
    _r_family,
    _r_days,
    _r_syllogism,
    _r_counting,
    _r_odd_one_out,
    _r_assignment,
    _r_directions,
    _r_misc,
    _r_common_sense,
)
_REASON_SUFFIX = ["", "", "", " Explain your reasoning.", " Think it through step by step."]


def _reasoning(rng: random.Random) -> list[list[str]]:
    return [[_suffixed(rng, f(rng), _REASON_SUFFIX) for _ in range(250)] for f in _REASONING_KINDS]


# ------------------------------------------------------------------------------------------
# coding

_LANGS = ["Python", "JavaScript", "C", "Java", "Go", "Rust", "C++"]
_CODE_TASKS = _items(
    """reverse a singly linked list
    check whether a string is a palindrome, ignoring punctuation and case
    parse one line of CSV that may contain quoted fields with commas
    print the numbers 1 to 100, writing "Fizz" for multiples of 4 and "Buzz" for multiples of 7
    do a binary search on a sorted array of integers and return the index or -1
    count how often each word appears in a text and return the three most common words
    check whether a string looks like a valid email address
    transpose a matrix stored as a list of rows
    merge two sorted arrays into one sorted array
    remove duplicates from an array while keeping the original order
    find the second largest number in an array
    compute the factorial of n without recursion
    check whether a number is prime
    list all primes below n with the Sieve of Eratosthenes
    convert a Roman numeral to an integer
    convert a non-negative integer to a binary string without library helpers
    count the vowels in a string
    capitalize the first letter of every word in a sentence
    rotate an array to the right by k positions
    check whether two strings are anagrams of each other
    flatten a nested list of integers
    implement a stack with push, pop and peek
    implement a fixed-size queue backed by a circular buffer
    find the longest word in a sentence
    compute the greatest common divisor of two integers
    sum the digits of an integer
    check whether the brackets in a string are balanced
    sort an array with insertion sort
    sort an array with merge sort
    sort an array with quicksort
    find the contiguous subarray with the largest sum
    compute the edit distance between two strings
    detect whether a linked list has a cycle
    find the common elements of two lists using a hash set
    group a list of words by their first letter
    compress a string with run-length encoding
    decode a run-length encoded string
    keep a running average of a stream of numbers
    convert a list of temperatures from Celsius to Fahrenheit
    count the lines, words and characters in a text file
    shuffle an array uniformly with the Fisher-Yates algorithm
    build a binary search tree with insert and contains operations
    do a breadth-first search on a graph stored as an adjacency list
    find the shortest path between two cells in a grid with walls
    implement a least-recently-used cache with a fixed capacity
    return the day of the week for a date given as YYYY-MM-DD
    format an integer with commas as thousands separators
    generate a random password of a given length with letters, digits and symbols
    check whether a year is a leap year
    find all pairs of numbers in an array that add up to a target
    generate all subsets of a small set
    generate all permutations of a string
    print the first n rows of Pascal's triangle
    find the one missing number in an array that should contain 1 to n
    count the islands in a grid of 0s and 1s
    split an arithmetic expression into number and operator tokens
    evaluate an expression written in reverse Polish notation
    multiply two matrices
    find the mode of a list of numbers
    retry a failing function call up to three times with exponential backoff
    read key=value lines from a config file into a map
    find the k most frequent elements in an array
    implement a trie that supports insert and prefix search
    compute the maximum of every sliding window of size k in an array
    check whether a binary tree is a valid binary search tree
    convert a string in snake_case to camelCase"""
)
_CODE_TEMPLATES = _items(
    """Write a {lang} function to {task}.
    In {lang}, how would you {task}? Please include the code.
    Write a {lang} program that can {task}.
    Show me {lang} code to {task}, and explain how it works.
    I need a {lang} solution to {task}. Keep it short and add comments.
    How do I {task} in {lang}? Also give the time complexity.
    Write {lang} code to {task}, with a couple of test cases.
    Using {lang}, {task}. Handle edge cases such as empty input.
    What's an idiomatic way to {task} in {lang}?"""
)
_SQL_TASKS = [
    ("employees(id, name, department, salary)", "find the average salary in each department"),
    ("employees(id, name, department, salary)", "list the three highest-paid employees"),
    ("employees(id, name, manager_id)", "show each employee's name next to their manager's name"),
    ("orders(id, customer_id, total, created_at)", "find the total sales for each month of 2023"),
    ("orders(id, customer_id, total, created_at)", "find customers who placed more than 5 orders"),
    (
        "customers(id, name, city) and orders(id, customer_id, total)",
        "list customers who have never placed an order",
    ),
    ("products(id, name, category, price)", "find the most expensive product in each category"),
    ("students(id, name) and grades(student_id, course, grade)", "compute each student's GPA"),
    ("logins(user_id, login_time)", "count how many distinct users logged in each day"),
    ("books(id, title, author, year)", "find authors who published books in three or more years"),
    ("rentals(id, movie_id, rented_at, returned_at)", "find rentals that are overdue by 7 days"),
    ("employees(id, name, salary)", "find the second highest salary"),
    ("sales(region, product, amount)", "rank products by sales within each region"),
    ("users(id, email)", "find email addresses that appear more than once"),
    ("events(id, user_id, type, ts)", "find each user's first event"),
]
_SQL_TEMPLATES = _items(
    """Given a table {schema}, write a SQL query to {task}.
    I have the table {schema}. How do I {task} in SQL?
    Write a SQL query that will {task}. The schema is {schema}.
    Using the schema {schema}, {task}. Explain the query."""
)
_SHELL_TASKS = _items(
    """rename every .txt file in a folder to .md
    find the ten largest files under a directory
    count the lines in all Python files in a project, recursively
    back up a folder into a tar.gz archive with today's date in the name
    print the lines of a log file that contain ERROR, with line numbers
    warn when disk usage on the root partition goes above 90 percent
    loop over a list of hostnames and check whether each one responds to ping
    replace one word with another in every file of a directory
    show the five most common IP addresses in a web server access log
    print the second column of a CSV file
    delete files older than 30 days in a temporary folder
    check whether a process with a given name is running"""
)
_SHELL_TEMPLATES = _items(
    """Write a Bash script to {task}.
    Give me a shell one-liner to {task}.
    How can I {task} from the Linux command line?"""
)
_REGEX_TASKS = _items(
    """US-style phone numbers such as (555) 123-4567 | dates in the format DD/MM/YYYY |
    hexadecimal color codes like #1a2b3c | IPv4 addresses | words that start with a capital letter |
    time values in 24-hour HH:MM format | postal codes made of five digits |
    URLs that start with http or https | strings that contain only letters and spaces |
    lines that end with a semicolon | repeated words like "the the" |
    dollar amounts like $1,234.56"""
)
_REGEX_TEMPLATES = _items(
    """Write a regular expression that matches {task}, and explain each part.
    How would I match {task} with a regex in {lang}?
    Give me a regex for {task} and a few strings it should and should not match."""
)
_CONCEPTS_CODE = _items(
    """What is the difference between a list and a tuple in Python?
    Explain recursion with a simple example.
    What is Big-O notation, and why does it matter?
    Explain the difference between a stack and a queue.
    What does "pass by reference" mean, compared with "pass by value"?
    When should I use a hash map instead of an array?
    What is a race condition, and how can it be prevented?
    Explain what a REST API is.
    What are the benefits of writing unit tests?
    Explain the difference between git merge and git rebase.
    What is dependency injection?
    What is memoization, and when is it useful?
    How does garbage collection work in Java?
    What is the difference between == and === in JavaScript?
    What are pointers in C, and why are they useful?
    Explain Rust's ownership and borrowing rules.
    What are goroutines and channels in Go?
    What is a SQL JOIN? Describe the different kinds.
    What is the difference between a process and a thread?
    What is a database index, and when does it help?
    What is the difference between compiled and interpreted languages?
    Explain the four main ideas of object-oriented programming.
    What is functional programming?
    What is a closure in JavaScript?
    What are Python decorators, and how do they work?
    Explain async and await.
    What is a deadlock?
    What is the difference between TCP and UDP?
    Why should I use a virtual environment in Python?
    How does a hash table handle collisions?
    When is a linked list better than an array?
    What is test-driven development?
    What is the difference between SQL and NoSQL databases?
    What makes code readable?
    Explain the singleton and observer design patterns.
    What is the difference between stack and heap memory?
    What does a compiler do, step by step?
    Explain Docker containers in simple terms.
    What is continuous integration?
    What are templates in C++ and generics in Java?
    What is an off-by-one error? Give an example.
    What is the difference between an abstract class and an interface?
    How do I read a stack trace to find a bug?
    What is the difference between shallow copy and deep copy?"""
)
_CONCEPT_SUFFIX = ["", " Keep it brief.", " Use an analogy.", " Include a short code example."]

# (language, code, has_bug) -- small synthetic snippets
_SNIPPETS = [
    ("Python", "def mean(xs):\n    return sum(xs) / len(xs) if xs else 0.0", False),
    (
        "Python",
        "def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n"
        "        counts[word] = counts.get(word, 0) + 1\n    return counts",
        False,
    ),
    (
        "Python",
        "def is_sorted(items):\n    return all(a <= b for a, b in zip(items, items[1:]))",
        False,
    ),
    (
        "Python",
        "def chunk(items, size):\n"
        "    return [items[i:i + size] for i in range(0, len(items), size)]",
        False,
    ),
    (
        "Python",
        "class Stack:\n    def __init__(self):\n        self._items = []\n\n"
        "    def push(self, x):\n"
        "        self._items.append(x)\n\n    def pop(self):\n        return self._items.pop()",
        False,
    ),
    (
        "Python",
        'with open("data.txt") as f:\n    lines = [line.strip() for line in f if line.strip()]\n'
        "print(len(lines))",
        False,
    ),
    (
        "Python",
        "def gen():\n    a, b = 0, 1\n    while True:\n        yield a\n        a, b = b, a + b",
        False,
    ),
    ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items", True),
    ("Python", "def last_n(items, n):\n    return items[-n:]", True),
    (
        "Python",
        "def find_max(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n"
        "            best = n\n    return best",
        True,
    ),
    (
        "Python",
        'for i in range(len(names)):\n    if names[i] == "":\n        names.remove(names[i])',
        True,
    ),
    (
        "JavaScript",
        "function debounce(fn, ms) {\n  let timer;\n  return (...args) => {\n"
        "    clearTimeout(timer);\n    timer = setTimeout(() => fn(...args), ms);\n  };\n}",
        False,
    ),
    (
        "JavaScript",
        'const total = orders\n  .filter((o) => o.status === "paid")\n'
        "  .reduce((sum, o) => sum + o.amount, 0);",
        False,
    ),
    (
        "JavaScript",
        "async function getJson(url) {\n  const res = await fetch(url);\n"
        "  if (!res.ok) throw new Error(`HTTP ${res.status}`);\n  return res.json();\n}",
        False,
    ),
    ("JavaScript", "function unique(arr) {\n  return [...new Set(arr)];\n}", False),
    (
        "JavaScript",
        "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 100);\n}",
        True,
    ),
    (
        "JavaScript",
        "function isEqual(a, b) {\n  return a == b;\n}\nconsole.log(isEqual([1, 2], [1, 2]));",
        True,
    ),
    ("JavaScript", "const nums = [10, 1, 3, 25];\nnums.sort();\nconsole.log(nums);", True),
    (
        "C",
        "int sum_array(const int *a, size_t n) {\n    int s = 0;\n"
        "    for (size_t i = 0; i < n; i++) s += a[i];\n    return s;\n}",
        False,
    ),
    ("C", "void swap(int *a, int *b) {\n    int t = *a;\n    *a = *b;\n    *b = t;\n}", False),
    (
        "C",
        'char *greet(void) {\n    char buf[32];\n    strcpy(buf, "hello");\n    return buf;\n}',
        True,
    ),
    (
        "C",
        "int main(void) {\n    int a[5];\n    for (int i = 0; i <= 5; i++) a[i] = i * i;\n"
        "    return 0;\n}",
        True,
    ),
    ("C", 'if (x = 0) {\n    printf("x is zero\\n");\n}', True),
    (
        "Java",
        "public static int countChar(String s, char c) {\n    int count = 0;\n"
        "    for (char ch : s.toCharArray()) {\n        if (ch == c) count++;\n    }\n"
        "    return count;\n}",
        False,
    ),
    (
        "Java",
        'Map<String, Integer> ages = new HashMap<>();\nages.put("Ana", 31);\nages.put("Ben", 27);\n'
        "for (Map.Entry<String, Integer> e : ages.entrySet()) {\n"
        '    System.out.println(e.getKey() + " is " + e.getValue());\n}',
        False,
    ),
    (
        "Java",
        'String a = new String("hi");\nString b = new String("hi");\nif (a == b) {\n'
        '    System.out.println("same");\n}',
        True,
    ),
    (
        "Java",
        "List<Integer> xs = new ArrayList<>(List.of(1, 2, 3, 4));\nfor (Integer x : xs) {\n"
        "    if (x % 2 == 0) xs.remove(x);\n}",
        True,
    ),
    (
        "Go",
        "func reverse(s string) string {\n\tr := []rune(s)\n"
        "\tfor i, j := 0, len(r)-1; i < j; i, j = i+1, j-1 {\n\t\tr[i], r[j] = r[j], r[i]\n\t}\n"
        "\treturn string(r)\n}",
        False,
    ),
    (
        "Go",
        "func worker(jobs <-chan int, results chan<- int) {\n\tfor j := range jobs {\n"
        "\t\tresults <- j * 2\n\t}\n}",
        False,
    ),
    ("Go", 'func main() {\n\tvar m map[string]int\n\tm["a"] = 1\n\tfmt.Println(m)\n}', True),
    ("Rust", "fn largest(xs: &[i32]) -> Option<i32> {\n    xs.iter().copied().max()\n}", False),
    (
        "Rust",
        "fn word_lengths(text: &str) -> Vec<usize> {\n"
        "    text.split_whitespace().map(|w| w.len()).collect()\n}",
        False,
    ),
    (
        "Rust",
        'fn main() {\n    let s = String::from("hello");\n    let t = s;\n'
        '    println!("{} {}", s, t);\n}',
        True,
    ),
    (
        "C++",
        "std::vector<int> evens(const std::vector<int>& v) {\n    std::vector<int> out;\n"
        "    std::copy_if(v.begin(), v.end(), std::back_inserter(out),\n"
        "                 [](int x) { return x % 2 == 0; });\n    return out;\n}",
        False,
    ),
    (
        "C++",
        "std::vector<int> v = {1, 2, 3};\nfor (auto it = v.begin(); it != v.end(); ++it) {\n"
        "    if (*it == 2) v.erase(it);\n}",
        True,
    ),
    (
        "SQL",
        "SELECT department, COUNT(*) AS n, AVG(salary) AS avg_salary\nFROM employees\n"
        "GROUP BY department\nHAVING COUNT(*) > 5\nORDER BY avg_salary DESC;",
        False,
    ),
    (
        "SQL",
        "SELECT c.name, o.total\nFROM customers c\nLEFT JOIN orders o ON c.id = o.customer_id\n"
        "WHERE o.total > 100;",
        False,
    ),
    ("SQL", "SELECT name, MAX(score)\nFROM results\nWHERE MAX(score) > 90;", True),
    ("Bash", 'for f in *.log; do\n  gzip "$f"\ndone', False),
    ("Bash", 'name=John Smith\nif [ $name == "John Smith" ]; then\n  echo "hi"\nfi', True),
]
_SNIPPET_OK = _items(
    """Explain what this {lang} code does:
    What is the time complexity of this {lang} code?
    Refactor this {lang} code to make it more readable:
    Add helpful comments to this {lang} code:
    Write unit tests for this {lang} code:
    Rewrite this {lang} code in {other}:
    How could this {lang} code be improved?
    Walk through what this {lang} code does for a small example input:"""
)
_SNIPPET_BUG = _items(
    """This {lang} code has a bug. Find it and fix it:
    Why doesn't this {lang} code work as expected?
    Explain the bug in this {lang} snippet and suggest a fix:
    What does this {lang} code actually do, and is it correct?
    A code reviewer flagged this {lang} snippet. What is wrong with it?"""
)
_FENCE = {"C++": "cpp", "C": "c", "Bash": "bash", "SQL": "sql"}


def _coding(rng: random.Random) -> list[list[str]]:
    general = []
    for task in _CODE_TASKS:
        for lang in _LANGS:
            for tpl in rng.sample(_CODE_TEMPLATES, 3):
                general.append(tpl.format(lang=lang, task=task))
    sql = [tpl.format(schema=s, task=t) for s, t in _SQL_TASKS for tpl in _SQL_TEMPLATES]
    shell = [tpl.format(task=t) for t in _SHELL_TASKS for tpl in _SHELL_TEMPLATES]
    regex = [
        tpl.format(task=t, lang=rng.choice(["Python", "JavaScript", "Java", "Go"]))
        for t in _REGEX_TASKS
        for tpl in _REGEX_TEMPLATES
    ]
    concepts = [q + s for q in _CONCEPTS_CODE for s in rng.sample(_CONCEPT_SUFFIX, 2)]
    snippets = []
    for lang, code, bug in _SNIPPETS:
        fence = _FENCE.get(lang, lang.lower())
        for tpl in _SNIPPET_BUG if bug else _SNIPPET_OK:
            other = rng.choice([x for x in _LANGS if x != lang])
            ask = tpl.format(lang=lang, other=other)
            snippets.append(f"{ask}\n\n```{fence}\n{code}\n```")
    return [general, sql + shell + regex, concepts, snippets]


# ------------------------------------------------------------------------------------------
# extraction: synthetic passages with a task

_CO_HEAD = _items(
    "Quill | Tarn | Solv | Bright | Kel | Raven | Ember | Cobalt | Juniper | Lumen | Marrow |"
    "Nimbus | Orchard | Pebble | Saffron | Tidal | Vesper | Willow | Zephyr | Granite"
)
_CO_TAIL = _items(
    "mark | way | ane Labs | moor Foods | don Systems | soft | works | field Robotics |"
    "stone Outfitters | line Bikes | wood Health | gate Energy | crest Analytics | port Logistics"
)
_TOWNS = _items(
    "Eastbrook | Lindenfield | Port Avery | Millhaven | Ashcombe | Redwater | Northdale |"
    "Glenmoor | Stonebridge | Fairhollow | Brackenridge | Silverlake | Oakmere | Westvale"
)
_PRODUCTS = _items(
    "wireless earbuds | electric kettle | hiking backpack | robot vacuum | standing desk |"
    "e-reader | air fryer | rain jacket | mechanical keyboard | coffee grinder | yoga mat |"
    "smartwatch | blender | desk lamp | office chair | camping stove | bike helmet |"
    "portable speaker"
)
_PROS = _items(
    """it arrived two days early | the battery easily lasts a full day |
    setup took less than five minutes | it feels sturdy and well made |
    it is much quieter than my old one | the price was fair for the quality |
    the instructions were clear | it looks great on my desk |
    it is light enough to carry anywhere"""
)
_CONS = _items(
    """the power cable is too short | the companion app keeps logging me out |
    the surface scratches easily | customer service took a week to reply |
    it is heavier than it looks in the photos | the color is duller than advertised |
    one button stopped working after a month | it gets warm after an hour of use"""
)
_FIRST_F = _items("Ana | Lucia | Imani | Sara | Leila | Nadia | Mira | Clara | Esme | Juno | Petra")
_FIRST_M = _items("Marcus | Theo | Kenji | Daniel | Owen | Felix | Arjun | Tobias | Hamid")
_FIRST = _FIRST_F + _FIRST_M
_LAST = _items(
    "Okafor | Lindqvist | Moreau | Tanaka | Alvarez | Novak | Brennan | Haddad | Kowalski |"
    "Sato | Mendes | Whitfield | Adeyemi | Rossi | Larsen | Chen | Dubois | Farouk"
)
_PROJECTS = _items(
    "the website redesign | the new billing system | the spring marketing campaign |"
    "the warehouse move | the mobile app launch | the customer survey | the annual report"
)
_FIELDS = _items(
    "marine biology | civil engineering | music | economics | nursing | computer science |"
    "architecture | chemistry | journalism | agriculture"
)
_HOBBIES = _items(
    "sailing | chess | growing orchids | long-distance running | painting | baking |"
    "birdwatching | playing the cello | restoring old radios"
)
_DISHES = [
    ("banana bread", ["3 ripe bananas", "250 g flour", "100 g sugar", "2 eggs", "80 g butter"]),
    ("lentil soup", ["200 g red lentils", "1 onion", "2 carrots", "1 liter stock", "1 tsp cumin"]),
    ("pancakes", ["200 g flour", "2 eggs", "300 ml milk", "1 tbsp sugar", "a pinch of salt"]),
    ("tomato pasta", ["300 g pasta", "400 g canned tomatoes", "2 garlic cloves", "olive oil"]),
    ("oat cookies", ["150 g oats", "100 g butter", "80 g brown sugar", "1 egg", "50 g raisins"]),
    ("vegetable curry", ["1 onion", "2 potatoes", "1 can chickpeas", "400 ml coconut milk"]),
]


def _date(r: random.Random) -> str:
    return f"{r.choice(_MONTHS)} {r.randrange(1, 29)}"


def _person(r: random.Random) -> str:
    return f"{r.choice(_FIRST)} {r.choice(_LAST)}"


def _company(r: random.Random) -> str:
    return r.choice(_CO_HEAD) + r.choice(_CO_TAIL)


def _x_review(r: random.Random) -> tuple[str, list[str]]:
    prod, brand = r.choice(_PRODUCTS), _company(r)
    p1, p2 = r.sample(_PROS, 2)
    con = r.choice(_CONS)
    stars = r.randrange(1, 6)
    when = r.choice(["last month", "three weeks ago", "in the spring", "for my birthday"])
    text = (
        f"I bought the {prod} from {brand} {when}. {_cap(p1)}, and {p2}. "
        f"On the downside, {con}. Overall I'd give it {stars} out of 5."
    )
    if r.random() < 0.4:
        text = f"Review by {_person(r)}: {text}"
    tasks = [
        "Rate the sentiment of this review from 1 (very negative) to 5 (very positive).",
        "List what the reviewer liked and disliked, as two bullet lists.",
        "Would this reviewer recommend the product? Answer and explain briefly.",
        "Write a polite reply from the company to this review.",
        'Return JSON with the keys "product", "brand", "pros", "cons" and "stars".',
    ]
    return text, tasks


def _x_meeting(r: random.Random) -> tuple[str, list[str]]:
    a, b, c = (_person(r) for _ in range(3))
    proj = r.choice(_PROJECTS)
    status = r.choice(["on schedule", "two weeks behind", "slightly over budget", "nearly done"])
    day = r.choice(_DAYS[:5])
    text = (
        f"Meeting notes, {_date(r)}. Attendees: {a}, {b}, {c}. {a} reported that {proj} is "
        f"{status}. {b} will send the updated budget to finance by {day}. {c} raised a concern "
        f"about testing time; the team agreed to add {r.randrange(2, 6)} extra days. "
        f"Next meeting: {_date(r)} at {r.randrange(9, 17)}:00."
    )
    tasks = [
        "List the action items from these notes, with the owner of each.",
        "Who attended the meeting, and when is the next one?",
        "Write a short follow-up email to the attendees summarizing these notes.",
        "What risks or concerns were mentioned?",
    ]
    return text, tasks


def _x_news(r: random.Random) -> tuple[str, list[str]]:
    co, town, ceo = _company(r), r.choice(_TOWNS), _person(r)
    what = r.choice(["electric bicycles", "frozen meals", "solar roof tiles", "budgeting software"])
    act = r.choice(
        [
            "open a second factory",
            f"hire {r.randrange(50, 900)} new workers",
            f"expand into {r.randrange(3, 12)} new countries",
            "cut its prices by ten percent",
        ]
    )
    g, rev = r.randrange(2, 60), r.randrange(5, 900)
    text = (
        f"{town}-based {co}, a maker of {what}, announced on {r.choice(_DAYS[:5])} that it will "
        f"{act} next year. The company said revenue grew {g}% last year to ${rev} million. "
        f'"Demand has never been stronger," said chief executive {ceo}. Analysts were more '
        f"cautious, pointing to rising costs."
    )
    tasks = [
        "Identify the people, organizations and places mentioned in this article.",
        "By what percentage did the company's revenue grow, and what was the total?",
        "Write a headline for this news story.",
        "Is the tone of this article optimistic, pessimistic, or balanced? Explain.",
        "Turn this article into a two-sentence summary for a newsletter.",
    ]
    return text, tasks


def _x_order(r: random.Random) -> tuple[str, list[str]]:
    picks = r.sample(_PRODUCTS, r.randrange(2, 4))
    lines, total = [], 0.0
    for p in picks:
        q, price = r.randrange(1, 4), round(r.uniform(9, 180), 2)
        total += q * price
        lines.append(f"{q} x {p} ({_money(price)} each)")
    ship = r.choice([0, 4.99, 7.5, 12])
    text = (
        f"Order #{r.randrange(10000, 99999)} confirmed. Items: {'; '.join(lines)}. "
        f"Shipping: {_money(ship)}. Ship to: {_person(r)}, {r.randrange(1, 300)} "
        f"{r.choice(['Elm', 'Harbor', 'Mill', 'Station', 'Garden'])} Street, {r.choice(_TOWNS)}. "
        f"Estimated delivery: {_date(r)}."
    )
    tasks = [
        "Extract the order number, items, quantities and delivery date as JSON.",
        "What is the total cost of this order, including shipping? Show the calculation.",
        "Write a short, friendly message telling the customer their order is on its way.",
        "Which item in this order is the most expensive per unit?",
    ]
    return text, tasks


def _x_weather(r: random.Random) -> tuple[str, list[str]]:
    town = r.choice(_TOWNS)
    kinds = ["sunny", "cloudy", "light rain", "heavy showers", "windy", "snow flurries", "foggy"]
    days = []
    for d in r.sample(_DAYS, 3):
        hi = r.randrange(-5, 34)
        days.append(f"{d}: {r.choice(kinds)}, high {hi}°C, low {hi - r.randrange(3, 11)}°C")
    text = f"Weather outlook for {town}. " + ". ".join(days) + "."
    tasks = [
        "Put this forecast into a table with columns for day, conditions, high and low.",
        "Which day is best for a picnic, and why?",
        "What should I pack for a three-day trip based on this forecast?",
        "Convert all the temperatures in this forecast to Fahrenheit.",
    ]
    return text, tasks


def _x_bio(r: random.Random) -> tuple[str, list[str]]:
    pron = r.choice(["She", "He", "They"])
    first = r.choice({"She": _FIRST_F, "He": _FIRST_M}.get(pron, _FIRST))
    name, town = f"{first} {r.choice(_LAST)}", r.choice(_TOWNS)
    year, years = r.randrange(1950, 1981), r.randrange(3, 20)
    enjoy, volunteer = ("enjoy", "volunteer") if pron == "They" else ("enjoys", "volunteers")
    text = (
        f"{name} was born in {year} in {town}. After studying {r.choice(_FIELDS)} at the "
        f"University of {r.choice(_TOWNS)}, {pron.lower()} worked as a "
        f"{r.choice(['teacher', 'consultant', 'designer', 'researcher', 'nurse'])} for {years} "
        f"years before founding {_company(r)} in {year + 22 + years}. "
        f"{pron} {enjoy} {r.choice(_HOBBIES)} and {volunteer} at a local "
        f"{r.choice(['animal shelter', 'library', 'food bank', 'youth club'])}."
    )
    tasks = [
        "Create a timeline of the key events in this biography.",
        "Rewrite this biography in the first person, as if the person wrote it.",
        "Extract the person's name, birth year, birthplace, studies and company as JSON.",
        "Write a one-sentence introduction of this person for a conference program.",
    ]
    return text, tasks


def _x_recipe(r: random.Random) -> tuple[str, list[str]]:
    dish, ingredients = r.choice(_DISHES)
    t, mins, serves = r.choice([160, 180, 200]), r.randrange(15, 65, 5), r.randrange(2, 9)
    text = (
        f"To make {dish} for {serves}, you will need {', '.join(ingredients)}. Prepare and mix "
        f"the ingredients, then cook for about {mins} minutes"
        + (f" in an oven at {t}°C." if r.random() < 0.5 else " over medium heat, stirring often.")
        + " Let it rest for five minutes before serving."
    )
    tasks = [
        "List the ingredients as a shopping list.",
        f"Rewrite this recipe for {serves * 2} people.",
        "Turn this recipe into numbered steps.",
        "How long does this recipe take in total, and what equipment is needed?",
    ]
    return text, tasks


def _x_schedule(r: random.Random) -> tuple[str, list[str]]:
    h = r.randrange(8, 11)
    names = [_person(r) for _ in range(3)]
    topics = r.sample(_THINGS, 3)
    text = (
        f"Conference schedule, {_date(r)}: {h}:00 registration and coffee; "
        f"{h}:30 keynote by {names[0]} on {topics[0]}; {h + 2}:00 panel on {topics[1]}; "
        f"{h + 3}:00 lunch; {h + 4}:00 workshop with {names[1]} on {topics[2]}; "
        f"{h + 6}:00 closing remarks by {names[2]}."
    )
    tasks = [
        "At what time is lunch, and who gives the closing remarks?",
        "Convert this schedule into a list with one event per line.",
        "If I can only attend in the afternoon, which sessions will I see?",
        "Write a short announcement promoting this conference.",
    ]
    return text, tasks


def _x_complaint(r: random.Random) -> tuple[str, list[str]]:
    prod, n = r.choice(_PRODUCTS), r.randrange(10000, 99999)
    problem = r.choice(
        [
            "arrived with a cracked case",
            "was the wrong color",
            "never arrived",
            "stopped working after two days",
        ]
    )
    text = (
        f"Hello, I am writing about order #{n}. The {prod} I received {problem}. I have been a "
        f"customer for {r.randrange(2, 10)} years and this is the first time I've had a problem. "
        f"I would like a {r.choice(['refund', 'replacement', 'repair'])} as soon as possible. "
        f"Thanks, {_person(r)}"
    )
    tasks = [
        "What does the customer want, and what went wrong?",
        "Write a polite response from the support team.",
        "Classify the urgency of this message as low, medium or high, and explain.",
        "Extract the order number, product, problem and requested solution as JSON.",
    ]
    return text, tasks


def _x_job(r: random.Random) -> tuple[str, list[str]]:
    co, town = _company(r), r.choice(_TOWNS)
    role = r.choice(["junior data analyst", "warehouse supervisor", "graphic designer", "nurse"])
    lo = r.randrange(30, 80)
    text = (
        f"{co} is hiring a {role} in {town}. Requirements: {r.randrange(1, 6)} years of "
        f"experience, good communication skills, and a driver's license. The salary range is "
        f"${lo},000 to ${lo + r.randrange(5, 25)},000 per year, with {r.randrange(20, 31)} days "
        f"of paid leave. Applications close on {_date(r)}."
    )
    tasks = [
        "Summarize this job posting in three bullet points.",
        "Extract the role, location, salary range and deadline.",
        "Write a short cover letter for this job.",
        "What questions should a candidate ask about this job in an interview?",
    ]
    return text, tasks


def _x_listing(r: random.Random) -> tuple[str, list[str]]:
    beds, rent = r.randrange(1, 4), r.randrange(700, 3000, 50)
    text = (
        f"Bright {beds}-bedroom apartment in central {r.choice(_TOWNS)}, on the "
        f"{r.choice(['first', 'second', 'third', 'fifth', 'top'])} floor with an elevator. "
        f"Rent is ${rent} per month, utilities "
        f"{r.choice(['included', 'not included'])}. {r.randrange(3, 15)} minutes' walk to the "
        f"train station. {r.choice(['Pets welcome.', 'No pets.'])} Available from {_date(r)}."
    )
    tasks = [
        "List the pros and cons of this apartment for a family with a dog.",
        "Extract the number of bedrooms, rent, pet policy and availability date.",
        "Rewrite this listing to sound more appealing.",
        "What information is missing from this listing that a renter might want?",
    ]
    return text, tasks


def _x_event(r: random.Random) -> tuple[str, list[str]]:
    town = r.choice(_TOWNS)
    what = r.choice(["book swap", "repair cafe", "family movie night", "chess tournament"])
    text = (
        f"The {town} Public Library will host a {what} on {_date(r)} from {r.randrange(1, 6)} "
        f"to {r.randrange(6, 9)} pm. Entry is {r.choice(['free', '$3 per person'])}, and "
        f"snacks will be provided by {_company(r)}. Children under 12 must come with an adult. "
        f"Please register at the front desk by {_date(r)}."
    )
    tasks = [
        "When and where is the event, and how much does it cost?",
        "Write a tweet announcing this event.",
        "Rewrite this notice for a child to read.",
        "Make a list of the rules and requirements mentioned.",
    ]
    return text, tasks


def _x_incident(r: random.Random) -> tuple[str, list[str]]:
    minutes = r.randrange(5, 240)
    text = (
        f"Incident report: on {_date(r)} at {r.randrange(0, 24):02d}:{r.randrange(0, 60):02d}, "
        f"the {r.choice(['payment', 'login', 'search', 'email'])} service was unavailable for "
        f"{minutes} minutes. About {r.randrange(2, 95)}% of users were affected. The cause was "
        f"{r.choice(['an expired certificate', 'a full disk', 'a bad configuration change'])}. "
        f"Engineer {_person(r)} restored service. Follow-up: add monitoring and an alert."
    )
    tasks = [
        "Summarize this incident for a non-technical manager.",
        "What was the root cause, and how long was the outage?",
        "Suggest three ways to prevent this kind of incident.",
        'Return JSON with the keys "date", "service", "duration_minutes" and "cause".',
    ]
    return text, tasks


def _x_match(r: random.Random) -> tuple[str, list[str]]:
    town1, town2 = r.sample(_TOWNS, 2)
    t1, t2 = (f"{t} {r.choice(['Rovers', 'United', 'Falcons', 'Wolves'])}" for t in (town1, town2))
    s1, s2 = r.randrange(0, 5), r.randrange(1, 5)
    minute = r.randrange(2, 90)
    suffix = (
        "th" if minute % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(minute % 10, "th")
    )
    text = (
        f"{t1} and {t2} met on {r.choice(_DAYS)} in front of {r.randrange(2, 40) * 1000:,} fans. "
        f"The final score was {s1}-{s2}. {_person(r)} of {t2} scored in the {minute}{suffix} "
        f"minute, and goalkeeper {_person(r)} made several key saves. "
        f"The teams meet again on {_date(r)}."
    )
    tasks = [
        "Who won the match, and what was the score?",
        "Write this match report as a short, excited radio commentary.",
        "Extract the teams, score, attendance and players mentioned.",
        "Write a headline for this match report.",
    ]
    return text, tasks


_PASSAGE_KINDS = (
    _x_review,
    _x_meeting,
    _x_news,
    _x_order,
    _x_weather,
    _x_bio,
    _x_recipe,
    _x_schedule,
    _x_complaint,
    _x_job,
    _x_listing,
    _x_event,
    _x_incident,
    _x_match,
)
_GENERIC_TASKS = _items(
    """Summarize the following text in one sentence.
    Give this text a short, catchy title.
    List five keywords from this text.
    Rewrite the following text in simpler English.
    Extract all names, dates and numbers mentioned in this text.
    What is the main point of this text?
    Turn this text into three bullet points.
    Rewrite this text in a more formal tone.
    Write two questions that can be answered from this text, and answer them.
    Is the tone of this text positive, negative or neutral? Explain.
    Convert the key facts in this text into JSON."""
)
_EXTRACT_FORMATS = [
    "{task}\n\n{text}",
    "{task}\n\nText:\n{text}",
    'Here is a passage:\n\n"{text}"\n\n{task}',
    "{text}\n\n{task}",
    "Read the text below and do the following task. {task}\n\n{text}",
]


def _extraction(rng: random.Random) -> list[list[str]]:
    pools = []
    for make in _PASSAGE_KINDS:
        pool = []
        for _ in range(16):
            text, tasks = make(rng)
            for task in rng.sample(tasks, min(3, len(tasks))) + rng.sample(_GENERIC_TASKS, 5):
                pool.append(rng.choice(_EXTRACT_FORMATS).format(task=task, text=text))
        pools.append(pool)
    return pools


# ------------------------------------------------------------------------------------------
# knowledge: STEM and humanities

_SCIENCE = _items(
    """photosynthesis | cellular respiration | DNA replication | protein synthesis |
    natural selection | plate tectonics | the water cycle | the carbon cycle |
    the nitrogen cycle | entropy | Newton's laws of motion | gravity | black holes |
    the Big Bang theory | special relativity | quantum entanglement | the photoelectric effect |
    electromagnetic induction | Ohm's law | the Doppler effect | radioactive decay |
    nuclear fusion | nuclear fission | the periodic table | chemical bonding | acids and bases |
    oxidation and reduction | catalysts | the ideal gas law | buoyancy | friction | momentum |
    conservation of energy | sound waves | the refraction of light | lasers | semiconductors |
    superconductivity | magnetism | static electricity | the greenhouse effect |
    ocean currents | the jet stream | hurricanes | earthquakes | the rock cycle | erosion |
    fossilization | the immune system | how vaccines train the body | antibiotic resistance |
    viruses | bacteria | the circulatory system | the nervous system | hormones | digestion |
    metabolism | sleep cycles | neuroplasticity | genetic inheritance | mutations |
    stem cells | ecosystems | food webs | biodiversity | symbiosis | pollination |
    bird migration | circadian rhythms | the placebo effect | probability | prime numbers |
    the Pythagorean theorem | derivatives in calculus | integrals | logarithms |
    exponential growth | statistical sampling | correlation versus causation |
    the scientific method | algorithms | binary numbers | public-key cryptography |
    machine learning | neural networks | computer memory | operating systems |
    how the internet routes data | relational databases | compilers | cloud computing |
    blockchains | tides | the phases of the Moon | solar eclipses | the seasons |
    the solar system | exoplanets | dark matter | neutron stars | the speed of light |
    states of matter | osmosis | diffusion | the pH scale | half-life | the ozone layer |
    El Nino | volcanic eruptions | cloud formation | lightning | antimatter | the Higgs boson |
    chaos theory | fractals | infinity | the number zero | vectors | matrices |
    the germ theory of disease | the structure of the atom"""
)
_EVENTS = _items(
    """the French Revolution | the American Revolution | the Industrial Revolution |
    the Renaissance | the Protestant Reformation | the fall of the Western Roman Empire |
    the Crusades | the Mongol Empire | the Ming dynasty | the Meiji Restoration |
    the Age of Exploration | the Scientific Revolution | the Enlightenment |
    the abolition of the transatlantic slave trade | World War I | World War II |
    the Great Depression | the Cold War | the fall of the Berlin Wall |
    the American civil rights movement | the women's suffrage movement |
    the decolonization of Africa | the partition of India | the Russian Revolution |
    the Cuban Missile Crisis | the Apollo Moon landings | the building of the pyramids of Giza |
    Athenian democracy | the Roman Republic | the Han dynasty | the Ottoman Empire |
    the Inca Empire | the Viking Age | the Magna Carta | the Hundred Years' War |
    the Thirty Years' War | the Napoleonic Wars | the unification of Germany |
    the Irish Potato Famine | the California Gold Rush | the founding of the United Nations |
    the Marshall Plan | the invention of writing in Mesopotamia | the Neolithic Revolution |
    the Byzantine Empire | the Mali Empire | the Tang dynasty | the Spanish flu pandemic"""
)
_SOCIAL = _items(
    """inflation | supply and demand | opportunity cost | comparative advantage |
    compound interest | monopolies | recessions | unemployment | gross domestic product |
    fiscal policy | central banks | globalization | behavioral economics | game theory |
    the tragedy of the commons | democracy | federalism | the separation of powers |
    the rule of law | human rights | utilitarianism | Stoicism | existentialism |
    the social contract | free will | the trolley problem | cognitive dissonance |
    confirmation bias | the bystander effect | Maslow's hierarchy of needs |
    classical conditioning | the growth mindset | urbanization | population aging |
    the gig economy | the minimum wage | universal basic income | progressive taxation |
    free trade | tariffs | international law | propaganda | nationalism | feminism |
    linguistic relativity | how children learn language | cultural relativism |
    social mobility | public goods | externalities | Plato's allegory of the cave |
    Confucianism | the Four Noble Truths of Buddhism | Kant's categorical imperative |
    Occam's razor | logical fallacies | the Socratic method | epistemology"""
)
_ARTS = _items(
    """Impressionism | Cubism | Surrealism | Baroque music | Romantic poetry | the Gothic novel |
    the sonnet | jazz improvisation | the blues | minimalist art | Renaissance painting |
    linear perspective in drawing | Greek tragedy | Shakespeare's comedies | the hero's journey |
    magical realism | film noir | Art Deco | Gothic architecture | the Bauhaus |
    Japanese woodblock prints | Italian opera | classical ballet | hip-hop culture | Pop Art |
    Abstract Expressionism | the Harlem Renaissance | Dada | modernist poetry |
    oral storytelling traditions | Bollywood cinema | flamenco | Chinese calligraphy |
    Byzantine mosaics | Romanesque architecture | the epic poem"""
)
_KNOW_ANY = _items(
    """Explain {c} in simple terms.
    What is the basic idea behind {c}?
    Why is {c} important?
    What are common misconceptions about {c}?
    How would you teach {c} to a high school class?
    Give a short overview of {c}, with one real-world example.
    Write three quiz questions about {c}, with answers.
    Summarize {c} in three bullet points.
    What key terms should someone know to understand {c}?
    How is {c} relevant to everyday life?
    Can you describe {c} in a single paragraph?
    What would a beginner find confusing about {c}, and how would you clear it up?"""
)
_KNOW_KIND = {
    "science": _items(
        """How does {c} work?
        What evidence do scientists have for our understanding of {c}?
        What are the main steps or parts of {c}?
        How did scientists come to understand {c}?
        What are the practical applications of {c}?
        Describe a simple experiment or demonstration related to {c}.
        What are the open questions researchers still have about {c}?"""
    ),
    "event": _items(
        """What were the main causes of {c}?
        What were the long-term consequences of {c}?
        Who were the key figures in {c}?
        How do historians today view {c}?
        What was daily life like for ordinary people during {c}?
        Write a timeline of the most important moments of {c}.
        What lessons can we learn from {c}?"""
    ),
    "social": _items(
        """What are the main criticisms of {c}?
        Give a concrete example that illustrates {c}.
        Where do experts disagree about {c}?
        How does {c} show up in everyday decisions?
        Who first described {c}, and how has the idea changed since?
        What are the arguments for and against {c}?"""
    ),
    "arts": _items(
        """What are the defining features of {c}?
        Name some well-known works associated with {c} and explain why they matter.
        How did {c} influence later artists?
        How would you recognize an example of {c}?
        What historical context gave rise to {c}?
        Write a short museum-guide introduction to {c}."""
    ),
}


def _knowledge(rng: random.Random) -> list[list[str]]:
    pools = []
    for kind, concepts in (
        ("science", _SCIENCE),
        ("event", _EVENTS),
        ("social", _SOCIAL),
        ("arts", _ARTS),
    ):
        pool = []
        for c in concepts:
            for tpl in rng.sample(_KNOW_ANY, 4) + _KNOW_KIND[kind]:
                pool.append(tpl.format(c=c))
        pools.append(pool)
    return pools


# ------------------------------------------------------------------------------------------
# assembly

_BUILDERS: dict[str, Callable[[random.Random], list[list[str]]]] = {
    "topic": _topic,
    "roleplay": _roleplay,
    "math": _math,
    "reasoning": _reasoning,
    "coding": _coding,
    "extraction": _extraction,
    "knowledge": _knowledge,
}
SOURCES: tuple[str, ...] = tuple(_BUILDERS)


def _round_robin(streams: Iterable[Iterable[T]]) -> Iterator[T]:
    """One item from each stream in turn until all are exhausted."""
    its = [iter(s) for s in streams]
    while its:
        alive = []
        for it in its:
            for x in it:
                yield x
                alive.append(it)
                break
        its = alive


def _unique(stream: Iterable[str], seen: set[str]) -> Iterator[str]:
    """The items of ``stream`` not already in ``seen`` (normalized), recording each."""
    for x in stream:
        key = _norm(x)
        if key and key not in seen:
            seen.add(key)
            yield x


def _labelled(name: str, stream: Iterable[str]) -> Iterator[tuple[str, str]]:
    for x in stream:
        yield name, x


def diverse_prompts(n: int, seed: int) -> list[dict]:
    """n prompts as dict(source=<one of SOURCES>, prompt=<text>), deterministic for seed, no
    duplicates (case/space-insensitive), interleaved across sources (so any prefix of the list
    is a balanced mix). Fewer than n when n exceeds what is available."""
    seen: set[str] = set()
    streams = []
    for name, build in _BUILDERS.items():
        rng = random.Random(f"smollm2-prompts/{seed}/{name}")
        pools = build(rng)
        for pool in pools:
            rng.shuffle(pool)
        rng.shuffle(pools)
        streams.append(_labelled(name, _unique(_round_robin(pools), seen)))
    out = []
    for name, prompt in _round_robin(streams):
        if len(out) >= n:
            break
        out.append(dict(source=name, prompt=prompt))
    return out
